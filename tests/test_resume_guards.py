"""Resuming is explicit and never loses a user's files: changed settings are named, those
the data position depends on are refused, a finished run says so, a torn metrics line
is repaired, a user's own config.json is left alone, and Ctrl-C at start-up is one line."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
from pathlib import Path

import pytest

from moe_jax import trainer
from moe_jax.checkpoint import Checkpointer
from moe_jax.metrics import read_rows
from tests.test_trainer import TINY, _snapshot, _start, _train_cmd, _wait_for, tiny_config


def _ran(tmp_path: Path, two_step_run: Path) -> Path:
    """A copy of conftest's finished 2-step run of tiny_config (checkpoint 2), in
    `tmp_path` (as if it had been trained there)."""
    return Path(shutil.copytree(two_step_run, tmp_path / "run", symlinks=True))


def _refused(config, run: Path, *words: str) -> None:
    before = _snapshot(run)
    with pytest.raises(trainer.RunError) as error:
        trainer.run(config, run)
    assert "\n" not in str(error.value)
    for word in words:
        assert word in str(error.value), error.value
    assert _snapshot(run) == before


def test_changed_batch_size_is_refused_and_other_changes_are_named(tmp_path, two_step_run, capsys):
    run = _ran(tmp_path, two_step_run)
    _refused(tiny_config(steps=4, eval_every=0, batch_size=16), run, "train.batch_size=16", "8")
    capsys.readouterr()
    trainer.run(tiny_config(steps=3, eval_every=0, checkpoint_every=2, learning_rate=1e-3), run)
    out = capsys.readouterr().out
    assert "resuming step 2 with changed settings: train.learning_rate=0.001 (was 0.003), " in out
    assert "train.steps=3 (was 2)" in out


def test_a_finished_run_says_so_and_writes_nothing(tmp_path, two_step_run, capsys):
    run = _ran(tmp_path, two_step_run)
    before = _snapshot(run)
    capsys.readouterr()
    trainer.run(tiny_config(steps=1, eval_every=0, checkpoint_every=2), run)
    assert "already complete at step 2 (train.steps=1); nothing to do" in capsys.readouterr().out
    assert _snapshot(run) == before


def test_a_torn_last_metrics_line_is_repaired(tmp_path, two_step_run):
    run = _ran(tmp_path, two_step_run)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')  # a crash in the middle of a write
    trainer.run(tiny_config(steps=4, eval_every=0, checkpoint_every=2), run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # every line is whole again
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert read_rows(run / "metrics.jsonl") == rows


def test_a_users_own_config_json_is_never_overwritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"my": "notes"}\n')
    _refused(tiny_config(steps=1), run, "config.json", "not written by a run")


def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    run = tmp_path / "run"
    proc = _start(_train_cmd(run, *TINY, "--config.train.steps=50"))
    seen: list[str] = []

    def started() -> bool:  # the memory line comes just before the state is built
        seen.append(proc.stdout.readline())
        return "memory per device" in seen[-1]

    _wait_for(started, 120, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if "interrupted" not in err and proc.returncode == 0:
        pytest.skip("start-up ended before the signal arrived")
    assert proc.returncode in (130, 0), err  # 0: it reached the loop, which saves and stops
    assert "Traceback" not in err
    if proc.returncode == 130:
        assert err.strip().splitlines()[-1].startswith("error: interrupted (Ctrl-C)")


def test_resume_settings_come_from_the_checkpoint_not_its_files(tmp_path, two_step_run):
    """The compatibility check reads the saved config through orbax, so it holds whatever
    orbax names its files."""
    run = _ran(tmp_path, two_step_run)
    from moe_jax.checkpoint import Checkpointer

    saved = Checkpointer(run / "checkpoints", 3).saved_config(2)
    want = dataclasses.asdict(tiny_config(steps=2, eval_every=0, checkpoint_every=2))
    assert saved["model"] == want["model"] and saved["train"]["steps"] == 2


def test_a_disk_filling_during_the_run_stops_before_the_next_save(
    tmp_path, two_step_run, monkeypatch
):
    """Free space is checked again before each save (another writer may have taken it
    since the start): one line, nothing written, the last checkpoint intact."""
    import collections

    from moe_jax import checkpoint

    run = _ran(tmp_path, two_step_run)
    real, calls = checkpoint.shutil.disk_usage, []
    usage = collections.namedtuple("usage", "total used free")

    def filling(path):  # as at the start, then full
        calls.append(path)
        return real(path) if len(calls) == 1 else usage(10**9, 10**9, 1000)

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", filling)
    with pytest.raises(trainer.RunError) as error:
        trainer.run(tiny_config(steps=4, eval_every=0, checkpoint_every=2), run)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"not enough space to checkpoint step 4 in {run / 'checkpoints'}")
    assert "GB needed, 0.00 GB free" in message
    monkeypatch.undo()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
    trainer.run(tiny_config(steps=4, eval_every=0, checkpoint_every=2), run)  # resumes from 2
    assert [r["step"] for r in read_rows(run / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]


def test_a_checkpoint_write_that_fills_the_disk_is_one_line(tmp_path, monkeypatch):
    """A real full disk inside orbax's asynchronous write: the run checkpoints step 2, the
    file system is shrunk to what it then holds plus 200 KB (a checkpoint is about 1.1 MB),
    and the resumed run meets the full disk at step 4. One line naming the step and the
    directory (or, when the metrics file meets the full disk first, the error); the
    partial write is not a step, and the previous checkpoint stays the newest. The free
    space reported to the pre-checks is inflated, as when another writer races the save."""
    import collections

    from moe_jax import checkpoint
    from tests.small_disk import shrink_to_fit, small_disk

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage(10**12, 0, 10**12))
    with small_disk(tmp_path / "disk", "16m") as disk:
        run = disk / "run"
        trainer.run(tiny_config(steps=2, eval_every=0, checkpoint_every=2), run)
        shrink_to_fit(disk, 200_000)
        with pytest.raises(trainer.RunError) as error:
            trainer.run(tiny_config(steps=6, eval_every=0, checkpoint_every=2), run)
        message = str(error.value)
        assert "\n" not in message
        # Whichever write meets the full disk first: the checkpoint's, or the metrics'.
        checkpoint_failed = f"could not write the checkpoint of step 4 in {run / 'checkpoints'}"
        assert message.startswith(
            (f"{checkpoint_failed}: the disk is full", "stopping: No space left on device")
        ), message
        assert Checkpointer(run / "checkpoints", 3).steps() == [2]
        assert Checkpointer(run / "checkpoints", 3).newest_readable()[0] == 2


def test_a_checkpoint_saved_before_a_setting_existed_resumes_at_its_default(tmp_path):
    """A checkpoint's config written before a model setting was added (here the MTP,
    MLA and rotary-scaling ones) lacks it: it held the default, so the same defaults
    resume and another value is refused as another model."""
    from moe_jax import config as config_lib

    ours = dataclasses.asdict(config_lib.Config())
    added = ("mtp_depth", "attention", "kv_lora_rank", "rope_scaling", "rope_factor")
    saved = {**ours, "model": {k: v for k, v in ours["model"].items() if k not in added}}
    assert trainer._resume_changes(ours, saved, 2, tmp_path) == []
    deeper = {**ours, "model": {**ours["model"], "mtp_depth": 1}}
    with pytest.raises(ValueError, match=r"model\.mtp_depth=1 here but 0 there \(another model\)"):
        trainer._resume_changes(deeper, saved, 2, tmp_path)


def test_changing_the_optimizers_state_is_refused_and_a_checkpoint_from_before_it_was_adamw(
    tmp_path, two_step_run
):
    """Muon's state (one momentum per matrix) is not AdamW's: resuming under the other
    optimizer, or with clipping switched off, is refused in one line, nothing written; a
    checkpoint whose config predates `train.optimizer` held AdamW's state."""
    from moe_jax import config as config_lib

    run = _ran(tmp_path, two_step_run)
    muon = tiny_config(steps=4, eval_every=0, optimizer="muon")
    _refused(muon, run, "train.optimizer='muon' here but 'adamw' there", "optimizer's state")
    # clipping is a transformation of the saved state too: switching it off is refused
    # (it moved the good checkpoint aside as damaged); another threshold is not
    unclipped = tiny_config(steps=4, eval_every=0, grad_clip=0.0)
    _refused(unclipped, run, "train.grad_clip=0.0 here but 1.0 there", "optimizer's state")
    ours = dataclasses.asdict(config_lib.Config())
    threshold = lambda v: {**ours, "train": {**ours["train"], "grad_clip": v}}
    assert trainer._resume_changes(ours, threshold(2.0), 2, tmp_path) == [
        "resuming step 2 with changed settings: train.grad_clip=1.0 (was 2.0)"
    ]
    with pytest.raises(ValueError, match=r"train\.grad_clip=1\.0 here but 'x' there"):
        trainer._resume_changes(ours, threshold("x"), 2, tmp_path)  # a hand-edited checkpoint
    saved = {**ours, "train": {k: v for k, v in ours["train"].items() if k != "optimizer"}}
    assert trainer._resume_changes(ours, saved, 2, tmp_path) == []
    ours["train"]["optimizer"] = "muon"
    with pytest.raises(ValueError, match="'muon' here but 'adamw' there"):
        trainer._resume_changes(ours, saved, 2, tmp_path)


def test_float32_moments_resume_as_bf16_rounded_and_named(tmp_path, two_step_run, capsys):
    """`train.moment_dtype` is no other state tree: a float32 run resumes with bf16
    moments (named as a changed setting), each moment the float32 one rounded to bf16."""
    import jax
    import jax.numpy as jnp

    from moe_jax.parallel import mesh as mesh_lib
    from moe_jax.plan.resolve import resolve
    from moe_jax.train_state import init_state

    run = _ran(tmp_path, two_step_run)
    capsys.readouterr()
    bf16 = tiny_config(steps=3, eval_every=0, checkpoint_every=3, moment_dtype="bfloat16")
    trainer.run(bf16, run)
    out = capsys.readouterr().out
    assert "resuming step 2 with changed settings: " in out
    assert "train.moment_dtype='bfloat16' (was 'float32')" in out

    def restored(config, step):
        config = resolve(config, len(jax.devices()))
        layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
        _, state = init_state(config, layout)
        checkpoints = Checkpointer(run / "checkpoints", 3)
        state, _ = checkpoints.restore(step, state)
        checkpoints.close()
        return state.opt_state[1][0]  # (clipping, (adam, decay, schedule))

    saved, read = restored(tiny_config(), 2), restored(bf16, 2)
    assert {x.dtype for x in jax.tree.leaves(read.mu)} == {jnp.dtype(jnp.bfloat16)}
    for ours, theirs in zip(
        jax.tree.leaves((read.mu, read.nu)), jax.tree.leaves((saved.mu, saved.nu)), strict=True
    ):
        assert theirs.dtype == jnp.float32
        assert (ours == theirs.astype(jnp.bfloat16)).all()
    assert {x.dtype for x in jax.tree.leaves(restored(bf16, 3).nu)} == {jnp.dtype(jnp.bfloat16)}
