"""The trainer end to end: learning on real text, exact resume, crash safety,
signals, bad input, non-finite losses, profiling."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from moe_jax import config as config_lib
from moe_jax import trainer
from moe_jax.checkpoint import Checkpointer
from moe_jax.data import pipeline
from moe_jax.data.token_files import write_meta, write_split
from moe_jax.metrics import read_rows
from moe_jax.train_state import init_state
from tests import warm as warm_commands
from tests.bad_inputs import snapshot as _snapshot
from tests.commands import TINY, subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(**train) -> config_lib.Config:
    base = config_lib.Config()
    model = dataclasses.replace(base.model, embed_dim=32, head_dim=8, mlp_dim=64)
    moe = dataclasses.replace(base.moe, expert_mlp_dim=32)
    # Batch 8: in-process runs see the 8 forced test devices and split the batch over them.
    settings = {"batch_size": 8, "seq_len": 32, "eval_batches": 1, "log_every": 1, **train}
    cfg = dataclasses.replace(
        base, model=model, moe=moe, train=dataclasses.replace(base.train, **settings)
    )
    config_lib.validate(cfg)
    return cfg


def _env() -> dict[str, str]:
    return subprocess_env(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def _train_cmd(workdir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "moe_jax.train", f"--workdir={workdir}", *args]


def _train_cli(
    workdir: Path, *args: str, timeout: float = 300, warm: bool = False
) -> subprocess.CompletedProcess:
    """`python -m moe_jax.train` as a user types it, run to the end, output as text; with
    `warm`, forked from the warm interpreter of `tests.warm` (no start-up imports)."""
    if warm:
        return warm_commands.run(ROOT, _train_cmd(workdir, *args)[1:], _env(), timeout)
    return subprocess.run(
        _train_cmd(workdir, *args),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _start(cmd: list[str]) -> subprocess.Popen:
    """A training process in the background, its output captured as text."""
    return subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended early: {proc.communicate()}")
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def _final_params(workdir: Path, config: config_lib.Config):
    checkpoints = Checkpointer(workdir / "checkpoints", 3)
    _, like = init_state(config)
    state, _ = checkpoints.restore(checkpoints.latest_step(), like)
    checkpoints.close()
    return state


@pytest.mark.slow
def test_default_run_learns_real_text(default_run):
    """`python -m moe_jax.train` with the default config (conftest's `default_run`, whose
    checkpoint the sample and evaluate commands read too): val loss far below unigram
    entropy."""
    result, elapsed = default_run, default_run.seconds
    assert result.returncode == 0, result.stderr[-3000:]
    assert elapsed < 300, f"default run took {elapsed:.0f} s"
    run = default_run.workdir
    rows = read_rows(run / "metrics.jsonl")
    val_losses = [r["val_loss"] for r in rows if "val_loss" in r]
    config = config_lib.load(config_lib.to_config_dict(config_lib.Config()))
    tokens, _ = pipeline.token_stream(config.data, "val", config.model.vocab_size)
    entropy = pipeline.unigram_entropy(np.asarray(tokens))
    assert val_losses[-1] < 0.75 * entropy, (val_losses, entropy)
    required = {"step", "loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "lr"}
    required |= {"tokens_per_sec", "mfu", "expert_load_max_over_mean", "dropped_fraction"}
    required |= {"time", "step_time_s", "eta_s"}
    train_rows = [r for r in rows if "loss" in r]
    assert required <= set(train_rows[-1])
    assert train_rows[-1]["eta_s"] == 0 and train_rows[0]["time"] < train_rows[-1]["time"]
    # the first step compiles; its time is printed apart and kept out of the throughput
    first = float(
        re.search(r"first step \(compiling included\) took ([0-9.]+) s", result.stdout)[1]
    )
    assert max(r["step_time_s"] for r in train_rows) < first
    assert len(train_rows[-1]["expert_load_max_over_mean_per_layer"]) == 2
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 200
    assert list((run / "tb").glob("events.out.tfevents.*"))
    for picture in ("loss.png", "expert_load.png"):
        assert (run / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "checkpoints" / "200").is_dir()
    assert str(run) in result.stdout


def test_exact_resume_after_sigkill(tmp_path: Path):
    """N steps, SIGKILL, restart to 2N == 2N uninterrupted: same params, same logged losses."""
    n = 8
    args = [*TINY, f"--config.train.steps={2 * n}", f"--config.train.checkpoint_every={n}"]
    args += ["--config.train.eval_every=0"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    done = _train_cli(straight, *args, warm=True)
    assert done.returncode == 0, done.stderr[-3000:]

    proc = _start(_train_cmd(resumed, *args))
    _wait_for(lambda: (resumed / "checkpoints" / str(n)).is_dir(), 240, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (resumed / "checkpoints" / str(2 * n)).exists(), "killed too late to test resume"
    again = _train_cli(resumed, *args, warm=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {resumed / 'checkpoints' / str(n)}" in again.stdout

    def losses(run):
        return [(r["step"], r["loss"]) for r in read_rows(run / "metrics.jsonl") if "loss" in r]

    assert losses(resumed) == losses(straight)
    assert [s for s, _ in losses(resumed)] == list(range(1, 2 * n + 1))
    config = tiny_config(steps=2 * n, checkpoint_every=n, eval_every=0)
    a, b = _final_params(straight, config), _final_params(resumed, config)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


KILL_DURING_SAVE = textwrap.dedent(
    """
    import asyncio, sys
    from orbax.checkpoint._src.path import atomicity

    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def slow_finalize(self):
        if self._final_path.name == "4":  # the second checkpoint hangs before its rename
            await asyncio.sleep(600)
        await original(self)

    atomicity.AtomicRenameTemporaryPath.finalize = slow_finalize
    from absl import app
    from moe_jax import train
    sys.argv = ["train", *sys.argv[1:]]
    app.run(train.main)
    """
)


def test_kill_during_async_save_resumes_from_previous(tmp_path: Path):
    run = tmp_path / "run"
    args = [*TINY, "--config.train.steps=6", "--config.train.checkpoint_every=2"]
    args += ["--config.train.eval_every=0", f"--workdir={run}"]
    proc = _start([sys.executable, "-c", KILL_DURING_SAVE, *args])
    checkpoints = run / "checkpoints"
    _wait_for(lambda: checkpoints.is_dir() and list(checkpoints.glob("4.*tmp*")), 240, proc)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (checkpoints / "2").is_dir() and not (checkpoints / "4").exists()

    again = subprocess.run(
        _train_cmd(run, *args[:-1]), cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {checkpoints / '2'}" in again.stdout
    assert (checkpoints / "6").is_dir()


def test_sigterm_saves_and_stops(tmp_path: Path):
    """One process, in this one: SIGTERM mid-run finishes the step, saves it and stops
    (train.py turns `Stopped` into exit status 75; the SLURM test drives that exit and
    the requeue through a real job)."""
    run = tmp_path / "run"
    config = tiny_config(steps=100_000, checkpoint_every=0)
    sent = []

    def logged_rows() -> int:
        try:
            return len(read_rows(run / "metrics.jsonl"))
        except (OSError, ValueError):  # not written yet, or a line half written
            return 0

    def signal_after_three_steps():
        _wait_for(lambda: logged_rows() >= 3, 240)
        sent.append(time.time())
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=signal_after_three_steps, daemon=True)
    sender.start()
    with pytest.raises(trainer.Stopped, match=r"SIGTERM: stopped after step (\d+)") as stopped:
        trainer.run(config, run)
    assert time.time() - sent[0] < 30
    step = int(re.search(r"after step (\d+)", str(stopped.value))[1])
    assert (run / "checkpoints" / str(step)).is_dir()
    logged = max(r["step"] for r in read_rows(run / "metrics.jsonl") if "loss" in r)
    assert step <= logged + 1  # stopped within one step of the signal's arrival


def _prepared(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        write_split(data, split, rng.integers(0, 256, 5000).astype(np.uint16))
    meta = {
        "format": "moe_jax.tokens.v1",
        "dtype": "uint16",
        "vocab_size": 259,
        "tokenizer": "byte",
        "bos_id": 256,
        "eos_id": 257,
        "splits": {"train": {"num_tokens": 5000}, "val": {"num_tokens": 5000}},
    }
    write_meta(data, meta)
    return data


def _assert_rejected(config: config_lib.Config, workdir: Path, *words: str) -> None:
    before = _snapshot(workdir) if workdir.exists() else None
    with pytest.raises(trainer.RunError) as error:
        trainer.run(config, workdir)
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    after = _snapshot(workdir) if workdir.exists() else None
    assert after == before, "the workdir was modified"


def test_missing_data_path_is_rejected(tmp_path: Path):
    cfg = tiny_config(steps=2)
    cfg = dataclasses.replace(cfg, data=config_lib.DataConfig("tokens", str(tmp_path / "nope")))
    _assert_rejected(cfg, tmp_path / "run", "data.path", "nope", "does not exist")


def test_corrupt_bin_is_rejected(tmp_path: Path):
    data = _prepared(tmp_path)
    with (data / "train.bin").open("ab") as f:
        f.write(b"\0")  # 10001 bytes: not a whole number of uint16 tokens
    cfg = dataclasses.replace(tiny_config(steps=2), data=config_lib.DataConfig("tokens", str(data)))
    _assert_rejected(cfg, tmp_path / "run", "train.bin", "uint16")


def test_metadata_disagreeing_with_file_is_rejected(tmp_path: Path):
    data = _prepared(tmp_path)
    meta = json.loads((data / "meta.json").read_text())
    meta["splits"]["val"]["num_tokens"] = 7000
    (data / "meta.json").write_text(json.dumps(meta))
    cfg = dataclasses.replace(tiny_config(steps=2), data=config_lib.DataConfig("tokens", str(data)))
    _assert_rejected(cfg, tmp_path / "run", "val", "7000")


def test_checkpoint_of_incompatible_config_is_rejected(tmp_path: Path):
    run = tmp_path / "run"
    trainer.run(tiny_config(steps=2, eval_every=0), run)
    other = tiny_config(steps=4)
    other = dataclasses.replace(other, model=dataclasses.replace(other.model, embed_dim=64))
    _assert_rejected(other, run, "model.embed_dim", "32", "64")


def test_steps_whose_update_is_not_finite_are_skipped_and_stop_the_run(tmp_path, capsys):
    """A learning rate of inf (past the config's own check, which refuses it) keeps the
    loss and gradients finite but makes the update non-finite: each step is skipped and
    counted as a non-finite loss is (the log line, `skipped_steps_in_a_row`, the stop at
    train.max_bad_steps), and nothing non-finite is ever saved. (That a NaN loss sets the
    same `skipped` the trainer counts: tests/test_train_step.py.)"""
    cfg = tiny_config(steps=4, eval_every=0, warmup_steps=0)
    train = dataclasses.replace(cfg.train, learning_rate=float("inf"), max_bad_steps=2)
    with pytest.raises(trainer.RunError, match=r"2 steps in a row .*train\.max_bad_steps=2"):
        trainer.run(dataclasses.replace(cfg, train=train), tmp_path / "run")
    rows = read_rows(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["skipped_steps_in_a_row"]) for r in rows] == [(1, 1)]
    assert np.isfinite(rows[0]["loss"]) and np.isfinite(rows[0]["grad_norm"])
    out = capsys.readouterr().out
    assert "steps 1-1: 1 skipped (a non-finite loss, gradient or update)" in out
    assert "steps 2-2: 1 skipped" in out
    assert not list((tmp_path / "run" / "checkpoints").glob("[0-9]*"))


def test_profile_writes_a_trace(tmp_path: Path):
    cfg = tiny_config(steps=4, eval_every=0)
    cfg = dataclasses.replace(cfg, profile=config_lib.ProfileConfig("2,4"))
    trainer.run(cfg, tmp_path / "run")
    assert list((tmp_path / "run" / "profile").rglob("*.xplane.pb"))


def test_plan_that_does_not_fit_is_refused_before_compiling(tmp_path: Path):
    """The memory model's need against a limit: one line naming both, nothing written."""
    cfg = tiny_config(steps=2)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, memory_limit_gb=1e-4))
    _assert_rejected(cfg, tmp_path / "run", "GB per device", "0.0 GB are available")


def test_mixtral_on_this_machine_is_refused_in_one_line(tmp_path: Path):
    run = _train_cli(tmp_path / "run", "--config=configs/mixtral_8x7b.py")
    assert run.returncode == 1, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the plan needs") and "GB are available" in last, last
    assert "parameters: 46,7" in run.stdout  # Mixtral-8x7B: 46.7B parameters
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("stored", [True, False], ids=["max_id_stored", "measured"])
def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path: Path, stored: bool):
    """meta.json understating the vocabulary (ids up to 300, vocab_size 259) is caught when
    the split is opened, from prepare's stored max_id or by measuring the file, before
    training could turn the ids into NaN."""
    data = _prepared(tmp_path)
    tokens = np.random.default_rng(1).integers(0, 256, 5000).astype(np.uint16)
    tokens[1234] = 300
    write_split(data, "train", tokens)
    meta = json.loads((data / "meta.json").read_text())
    if stored:
        meta["splits"]["train"]["max_id"] = 300
    write_meta(data, meta)
    cfg = dataclasses.replace(tiny_config(steps=2), data=config_lib.DataConfig("tokens", str(data)))
    _assert_rejected(cfg, tmp_path / "run", "train.bin", "token id 300", "model.vocab_size=259")


def test_prepare_stores_each_splits_largest_id(tmp_path: Path):
    from moe_jax.data.prepare import prepare

    (tmp_path / "a.txt").write_text("hello world " * 200)
    prepare(tmp_path / "a.txt", tmp_path / "out", "byte", 0.1, "text")
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    for split in ("train", "val"):
        tokens = np.fromfile(tmp_path / "out" / f"{split}-00000.bin", np.uint16)
        assert meta["splits"][split]["max_id"] == int(tokens.max())


# 8 steps, warmup 2, peak 0.01, floor 0.001: the rate each step used, by hand.
SCHEDULES = {
    "constant": [0.0, 0.005, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01],
    # wsd_decay_fraction 0.5: stable to step 4, then linear to the floor at step 8.
    "wsd": [0.0, 0.005, 0.01, 0.01, 0.01, 0.01 - 0.009 / 4, 0.01 - 0.009 / 2, 0.01 - 0.027 / 4],
    # peak * sqrt(2 / step) from step 2, floored at 0.001 (never reached here).
    "inverse_sqrt": [0.0, 0.005, *(0.01 * np.sqrt(2 / s) for s in range(2, 8))],
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_schedule_from_the_command_line_sets_each_step_rate(tmp_path: Path, schedule: str):
    run = _train_cli(
        tmp_path / "run",
        *TINY,
        "--config.train.steps=8",
        "--config.train.warmup_steps=2",
        "--config.train.learning_rate=0.01",
        "--config.train.min_lr_ratio=0.1",
        "--config.train.eval_every=0",
        "--config.train.checkpoint_every=0",
        f"--config.train.schedule={schedule}",
        "--config.train.wsd_decay_fraction=0.5",
        warm=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [r for r in read_rows(tmp_path / "run" / "metrics.jsonl") if "lr" in r]
    assert [r["step"] for r in rows] == list(range(1, 9))
    np.testing.assert_allclose([r["lr"] for r in rows], SCHEDULES[schedule], rtol=1e-5)
    assert "warning" not in run.stdout + run.stderr


def test_warmup_as_long_as_the_run_warns_in_one_line(tmp_path: Path):
    run = _train_cli(
        tmp_path / "run",
        *TINY,
        "--config.train.steps=2",
        "--config.train.warmup_steps=2",
        "--config.train.eval_every=0",
        warm=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    warnings = [line for line in run.stdout.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: train.warmup_steps=2 >= train.steps=2: the learning rate never reaches "
        "its peak train.learning_rate=0.003"
    ]


def test_wandb_offline_logs_every_row_into_the_workdir(tmp_path, monkeypatch):
    """train.wandb='offline': the W&B run lives in the workdir (synced later with `wandb
    sync`) and its record holds each logged loss exactly as metrics.jsonl has it."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    trainer.run(tiny_config(steps=3, wandb="offline"), tmp_path)
    records = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(records) == 1, list((tmp_path / "wandb").rglob("*"))
    data = records[0].read_bytes()
    losses = [row["loss"] for row in read_rows(tmp_path / "metrics.jsonl") if "loss" in row]
    assert len(losses) == 3
    assert all(json.dumps(loss).encode() in data for loss in losses)


def test_wandb_credentials_are_found_where_wandb_looks(tmp_path):
    """`train.wandb=online` is refused up front only when wandb would find no key: none
    in the environment, in the netrc entry `wandb login` writes for its host (another
    host's does not count), or in its settings file."""
    from moe_jax.metrics import wandb_credentials

    home = {"HOME": str(tmp_path)}
    assert not wandb_credentials(home)
    assert wandb_credentials({**home, "WANDB_API_KEY": "k" * 40})
    (tmp_path / ".netrc").write_text("machine example.com login user password k\n")
    assert not wandb_credentials(home)
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password k\n")
    assert wandb_credentials(home)
    assert not wandb_credentials({**home, "WANDB_BASE_URL": "https://wandb.example.com"})
    settings = tmp_path / "wandb-config" / "settings"
    settings.parent.mkdir()
    settings.write_text("[default]\napi_key = k\n")
    assert wandb_credentials(
        {**home, "NETRC": "/nonexistent", "WANDB_CONFIG_DIR": str(settings.parent)}
    )
