"""Test setup: 8 forced CPU devices (for sharding tests) and the tests' compile flags
(`tests.commands.COMPILE_FLAGS`) before jax is imported."""

import gc
import os
import tempfile
import time

import pytest

from tests.commands import xla_flags  # imports no jax

os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiled programs are cached on disk and shared by the test process and the
# training subprocesses it starts (many tests compile the same tiny model).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="moe_jax_jit_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Tracing a train step makes millions of short-lived Python objects; at the default
# threshold (700 allocations) the cyclic collector takes ~20% of the tracing time
# (test_overlap.py: 130 s -> 123 s without it). Nothing here measures Python's memory.
gc.set_threshold(100_000, 50, 100)


# The files that take minutes, longest first (by their summed durations in CI):
# collected, and so handed out by pytest-xdist (`--dist loadfile
# --no-loadscope-reorder`, the Makefile's), before the rest, so that no long file
# starts last and keeps one worker busy after the other has finished.
LONG_FILES = (
    "test_plan_memory.py",
    "test_pipeline_1f1b.py",
    "test_parallel.py",
    "test_pipeline.py",
    "test_collective_matmul.py",
    "test_notebook.py",
    "test_trainer.py",
    "test_slurm.py",
    "test_hf_convert.py",
    "test_overlap.py",
    "test_fp8_exchange.py",
    "test_grad_exchange.py",
    "test_bench_gpu_check.py",
    "test_pipeline_state.py",
    "test_moe_block.py",
    "test_remat.py",
    "test_chaos.py",
    "test_distributed_optimizer.py",
    "test_sharded_weights.py",
    "test_layout_coverage.py",
    "test_ragged_exchange.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(LONG_FILES)))  # stable


@pytest.fixture(scope="session")
def hf_built(tmp_path_factory):
    """Every family's tiny random transformers model and the rotary and routing
    references (`tests.hf_side.build_all`), built once per session for the files that
    read them: architecture -> its directory."""
    from tests import hf_side
    from tests.once import made_once

    root = made_once(tmp_path_factory, "hf_built", hf_side.build_all)
    return lambda architecture: root / architecture


@pytest.fixture(scope="session")
def single_process_run(tmp_path_factory):
    """The uninterrupted run on the 8 test devices, in this process, that the
    multi-process runs must reproduce (made once per session, by whichever xdist worker
    first needs it)."""
    from moe_jax import trainer
    from tests import multihost
    from tests.once import made_once
    from tests.settings import make_config

    def make(workdir):
        settings = {**multihost.MODEL, **multihost.SAVED_PLAN}
        steps = multihost.STEPS + multihost.MORE_STEPS
        trainer.run(make_config({**settings, "train.steps": steps}), workdir)

    return made_once(tmp_path_factory, "single_process_run", make)


@pytest.fixture(scope="session")
def bad_input_run(tmp_path_factory):
    """A finished TINY run with checkpoints 2 and 4 that bad-input cases copy
    (`tests/bad_inputs.py`), trained once per session by the real command."""
    from tests import bad_inputs
    from tests.once import made_once

    return made_once(tmp_path_factory, "bad_input_run", bad_inputs.train_template)


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """`python -m moe_jax.train` with the default config, as a user types it (and at XLA's
    own level, as a user's run compiles: 200 steps take twice as long unoptimised), made
    once per session by whichever xdist worker first needs it: its workdir, exit status,
    output and seconds. test_trainer checks the run; sample and evaluate read it."""
    import json
    import subprocess
    import sys
    from types import SimpleNamespace

    from tests.commands import ROOT, subprocess_env
    from tests.once import made_once

    def make(directory):
        directory.mkdir(parents=True)
        command = [sys.executable, "-m", "moe_jax.train", f"--workdir={directory / 'run'}"]
        env = subprocess_env(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS="")
        start = time.time()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        result = dict(returncode=done.returncode, stdout=done.stdout, stderr=done.stderr)
        result["seconds"] = time.time() - start
        (directory / "result.json").write_text(json.dumps(result))

    directory = made_once(tmp_path_factory, "default_run", make)
    result = json.loads((directory / "result.json").read_text())
    return SimpleNamespace(workdir=directory / "run", **result)


@pytest.fixture(scope="session")
def two_step_run(tmp_path_factory):
    """A finished 2-step run of test_trainer's `tiny_config` (checkpoint 2) on the 8 test
    devices, trained once per session for the tests that copy it."""
    from moe_jax import trainer
    from tests.once import made_once
    from tests.test_trainer import tiny_config

    def make(run):
        trainer.run(tiny_config(steps=2, eval_every=0, checkpoint_every=2), run)

    return made_once(tmp_path_factory, "two_step_run", make)
