"""A damaged newest checkpoint is reported in one line, moved aside (never deleted), and
the run resumes from the one before it, exactly as if nothing had happened."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moe_jax import trainer
from moe_jax.metrics import read_rows
from tests.test_trainer import tiny_config


def _config(steps: int):
    return tiny_config(steps=steps, eval_every=0, checkpoint_every=2)


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_rows(run / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[tuple[int, float]]:
    """The losses of the uninterrupted 6-step run."""
    run = tmp_path_factory.mktemp("straight") / "run"
    trainer.run(_config(6), run)
    return _losses(run)


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> Path:
    """The same run stopped after step 4 (checkpoints 2 and 4), trained once and copied
    by each case before it damages the newest checkpoint."""
    run = tmp_path_factory.mktemp("four_steps") / "run"
    trainer.run(_config(4), run)
    return run


def _truncate_a_data_file(step_dir: Path) -> None:
    data = max(
        (p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _empty_the_state(step_dir: Path) -> None:
    for p in sorted((step_dir / "state").rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()


def _garble_the_config(step_dir: Path) -> None:
    for p in (step_dir / "config").iterdir():
        if p.is_file():
            p.write_text("{not json")


def _config_of_no_sections(step_dir: Path) -> None:
    """Valid JSON, but a section that is not one (a hand edit)."""
    for p in (step_dir / "config").iterdir():
        if p.is_file():
            p.write_text('{"train": [1.0]}')


DAMAGE = {
    "truncated": _truncate_a_data_file,
    "state_emptied": _empty_the_state,
    "config_garbled": _garble_the_config,
    "config_not_sections": _config_of_no_sections,
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes(
    tmp_path, straight, four_steps, capsys, kind
):
    run = Path(shutil.copytree(four_steps, tmp_path / "run", symlinks=True))
    newest = run / "checkpoints" / "4"
    DAMAGE[kind](newest)
    capsys.readouterr()

    trainer.run(_config(6), run)
    out = capsys.readouterr().out
    damaged = [line for line in out.splitlines() if "is damaged" in line]
    assert len(damaged) == 1 and damaged[0].startswith(f"checkpoint {newest} is damaged ("), out
    assert f"moved to {run / 'checkpoints-damaged' / '4'}" in damaged[0]
    assert f"resumed from {run / 'checkpoints' / '2'}" in out
    assert (run / "checkpoints-damaged" / "4").is_dir()  # kept, not deleted
    assert _losses(run) == straight  # steps 3-6 again, exactly as an uninterrupted run
