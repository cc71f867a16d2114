"""`bench/gpu_check.py`, the GPU session script, as an offline GPU machine would run it:
from a plain checkout in another directory, with no editable install and without the
packages such a machine lacks; its report written after every section, kept when the
run is stopped by SIGINT, and a small budget skipping sections instead of overrunning.
On CPU (`--small`) the Pallas kernels run interpreted: a dry run of every section.

One `--small` run does the work of the long test (the minimal environment, the
report after every section and the checks' results); the signal and budget cases run
a few short sections only.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import sysconfig
import time
import venv
from pathlib import Path

import pytest

from tests.commands import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"
# What an offline GPU image lacks (grain, tensorboardX), or what only some runs need.
BLOCKED = ("ml_collections", "grain", "orbax", "tensorboardX", "tokamax", "wandb", "matplotlib")
ALL_SECTIONS = (
    "versions",
    "kernel_correctness",
    "attention_correctness",
    "block_correctness",
    "gemm_timing",
    "block_timing",
    "permutation_timing",
    "ragged_exchange",
    "attention_timing",
)


@pytest.fixture(scope="module")
def minimal_python(tmp_path_factory) -> Path:
    """A Python that sees this test environment's packages but not its editable install
    of moe_jax (their .pth files are not read) and cannot import BLOCKED."""
    home = tmp_path_factory.mktemp("minimal") / "venv"
    venv.create(home, with_pip=False, symlinks=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(home)}))
    site.mkdir(parents=True, exist_ok=True)
    (site / "packages.pth").write_text(sysconfig.get_path("purelib") + "\n")
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"for name in {BLOCKED!r}:\n"
        "    sys.modules[name] = None  # import fails; find_spec finds nothing\n"
    )
    return home / "bin" / "python"


def _env() -> dict[str, str]:
    env = subprocess_env(JAX_PLATFORMS="cpu")
    env.pop("PYTHONPATH", None)
    return env


def _start(python: Path, out: Path, *flags: str, cwd: Path) -> subprocess.Popen:
    """`python bench/gpu_check.py --small --out OUT FLAGS` from `cwd`, stdout read as it
    comes (stderr into a file beside OUT: a full pipe would stall the run)."""
    with open(out.parent / "stderr.txt", "w") as stderr:
        return subprocess.Popen(
            [str(python), str(SCRIPT), "--small", "--out", str(out), *flags],
            cwd=cwd,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )


def _finish(run: subprocess.Popen, lines: list[str]) -> tuple[int, list[str], str]:
    """Exit status, every stdout line and the stderr of a run `_start` began."""
    rest, _ = run.communicate(timeout=600)
    err = (Path(run.args[4]).parent / "stderr.txt").read_text()
    return run.returncode, lines + rest.splitlines(), err


def test_the_minimal_environment_lacks_what_it_should(minimal_python, tmp_path):
    """The environment the runs below use: no moe_jax from outside the checkout, none of
    BLOCKED, but jax and flax."""
    probe = "import importlib.util as u, sys; print([u.find_spec(n) is None for n in sys.argv[1:]])"
    names = ["moe_jax", *BLOCKED, "jax", "flax"]
    done = subprocess.run(
        [str(minimal_python), "-c", probe, *names],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(done.stdout.lower()) == [True] * (1 + len(BLOCKED)) + [False, False]


@pytest.mark.slow
def test_dry_run_in_a_minimal_environment_writes_its_report_after_every_section(
    minimal_python, tmp_path
):
    """Every section runs and passes; after each one the report on disk is whole JSON
    holding it; the last stdout line is that report; the log holds the run's output."""
    out = tmp_path / "out"
    run = _start(minimal_python, out, cwd=tmp_path)
    seen, lines = [], []
    for line in run.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("section ") and line.rstrip().endswith(" s"):
            name = line.split()[1].rstrip(":")
            report = json.loads((out / "gpu_check.json").read_text())  # whole at any time
            assert report["sections"][name] == "done", (name, report["failures"])
            seen.append(name)
    status, lines, err = _finish(run, lines)
    assert status == 0, err[-3000:]
    assert seen == list(ALL_SECTIONS)
    report = json.loads(lines[-1])
    assert report == json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] and report["complete"] and report["failures"] == [], report["failures"]
    assert next(iter(report)) == "versions"  # the report's first field
    assert lines[0].startswith("versions gpu: ")  # and the first line printed
    versions = report["versions"]
    assert versions["ml-collections"] == "not installed" and versions["jax"] != "not installed"
    log = (out / "gpu_check.log").read_text()
    assert all(f"section {name}: " in log for name in ALL_SECTIONS)
    for impl in ("ragged_dot", "tiled", "pallas"):
        assert f"softmax_top2/{impl}" in report["block_correctness"]["max_rel_error"]
        for dtype in ("float32", "bfloat16"):
            assert f"{impl}/{dtype}" in report["kernel_correctness"]["products"]
        assert any(key.endswith(f"/{impl}_tflops") for key in report["gemm_timing"]["tflops"])
    assert set(report["kernel_correctness"]["fused"]) == {
        f"{op}/{dtype}" for op in ("gather_gmm", "gmm_scatter") for dtype in ("float32", "bfloat16")
    }
    assert any(key.endswith("pallas_fused_overhead") for key in report["permutation_timing"])
    assert "model/float32/padded_vs_single" in report["ragged_exchange"]["max_rel_error"]
    assert "blockwise/bf16_ms" in report["attention_timing"]


def test_sigint_keeps_the_finished_sections_and_names_the_rest(tmp_path):
    """SIGINT during a section: the report holds the sections done, names the one
    stopped and those not run, and is the last stdout line; exit status 130."""
    out = tmp_path / "out"
    sections = "attention_correctness,block_correctness,attention_timing"
    run = _start(Path(sys.executable), out, "--sections", sections, cwd=tmp_path)
    lines = []
    for line in run.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("section attention_correctness: "):
            time.sleep(0.5)  # into block_correctness
            run.send_signal(signal.SIGINT)
            break
    status, lines, err = _finish(run, lines)
    assert status == 128 + signal.SIGINT, (lines[-30:], err[-3000:])
    report = json.loads(lines[-1])
    assert report == json.loads((out / "gpu_check.json").read_text())
    assert report["sections"] == {
        "versions": "done",
        "attention_correctness": "done",
        "block_correctness": "stopped: SIGINT",
        "attention_timing": "not run: SIGINT",
    }
    assert report["stopped"] == "SIGINT" and not report["complete"]
    assert "blockwise/f32_max_rel_error" in report["attention_correctness"]["cores"]
    assert "section attention_correctness: " in (out / "gpu_check.log").read_text()


def test_a_ten_second_budget_skips_sections_instead_of_overrunning(tmp_path):
    """Ten seconds: room for the versions section on a loaded 2-core machine (five were
    not, with four test processes on it), too little for kernel_correctness's 15."""
    out = tmp_path / "out"
    begin = time.monotonic()
    run = _start(Path(sys.executable), out, "--budget", "10", cwd=tmp_path)
    status, lines, err = _finish(run, [])
    wall = time.monotonic() - begin
    assert status == 0, err[-3000:]
    report = json.loads(lines[-1])
    assert report["elapsed_s"] <= 12 and wall < 30, (report["elapsed_s"], wall)  # + a compile
    states = report["sections"]
    assert list(states) == list(ALL_SECTIONS) and states["versions"] == "done"
    assert states["kernel_correctness"].startswith("skipped: needs 15 s")
    assert all(
        state.startswith(("done", "skipped: needs", "stopped: budget", "not run: budget"))
        for state in states.values()
    ), states
    assert not report["complete"] and report["ok"]


def test_the_gpu_machine_command_runs_gpu_check_with_its_budget(tmp_path):
    """`sh bench/gpu_run.sh OUT FLAGS`, the GPU machine's one command, installs the
    carried wheels if any and passes its flags on: the report lands in OUT."""
    env = {**_env(), "PYTHON": sys.executable, "BUDGET": "60", "WHEELS_SITE": str(tmp_path / "s")}
    done = subprocess.run(
        ["sh", str(ROOT / "bench" / "gpu_run.sh"), str(tmp_path / "out"), "--small",
         "--sections", "versions"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["sections"] == {"versions": "done"} and report["budget_s"] == 60
    assert json.loads(done.stdout.splitlines()[-1]) == report


def test_bad_flags_are_one_error_line(tmp_path):
    for flags, message in (
        (["--sections", "nope"], "error: --sections: unknown 'nope'; valid: versions,"),
        (["--budget", "0"], "error: --budget must be positive seconds, not 0"),
        (["--out", str(SCRIPT)], f"error: --out {SCRIPT} exists and is not a directory"),
    ):
        done = subprocess.run(
            [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, cwd=tmp_path
        )
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.splitlines() == [done.stderr.strip()]
        assert done.stderr.startswith(message), done.stderr


def test_a_program_too_large_for_the_device_is_skipped_before_it_runs():
    """`timing.check_fits` reads XLA's memory analysis of the compiled program: a
    ragged_dot whose buffers exceed the free memory given raises DoesNotFit."""
    import jax
    import jax.numpy as jnp

    spec = importlib.util.spec_from_file_location("bench_timing", ROOT / "bench" / "timing.py")
    timing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timing)
    x, w = jnp.ones((512, 64)), jnp.ones((8, 64, 256))
    sizes = jnp.full((8,), 64, jnp.int32)
    compiled = jax.jit(jax.lax.ragged_dot).lower(x, w, sizes).compile()
    output = 512 * 256 * 4
    timing.check_fits(compiled, free_bytes=100 * output)
    with pytest.raises(timing.DoesNotFit, match=r"needs 0\.00 GiB .* GiB free"):
        timing.check_fits(compiled, free_bytes=output // 2)


def test_gpu_wheels_downloads_the_wheels_an_offline_machine_installs(tmp_path):
    """`make gpu-wheels`'s script, then the offline install the docs give (skipped where
    no package index is reachable)."""
    wheels = tmp_path / "whl"
    done = subprocess.run(
        ["sh", str(ROOT / "bench" / "gpu_wheels.sh"), str(wheels)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    offline = ("Could not fetch URL", "NewConnectionError", "Network is unreachable",
               "Temporary failure in name resolution", "ProxyError", "ConnectTimeout")  # fmt: skip
    if done.returncode != 0 and any(word in done.stderr for word in offline):
        pytest.skip("no package index reachable")
    assert done.returncode == 0, done.stderr[-2000:]
    names = {path.name.split("-")[0].lower() for path in wheels.glob("*.whl")}
    assert names == {"ml_collections", "grain", "array_record", "cloudpickle", "portpicker",
                     "tensorboardx"}  # fmt: skip
    assert {p.name.split("-")[0] for p in (wheels / "fallback").glob("*.whl")} == {"flax", "optax"}
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
         "--no-compile", "--target", str(site), *map(str, wheels.glob("*.whl"))],
        check=True, capture_output=True,
    )  # fmt: skip
    probe = "import ml_collections, tensorboardX; print(ml_collections.__file__)"
    found = subprocess.run(
        [sys.executable, "-c", probe],
        env={**_env(), "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.startswith(str(site))
