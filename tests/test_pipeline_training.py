"""The trainer with a pipeline: `parallel.stages=2` trains end to end on 8 CPU devices
and logs the losses of the one-stage run over the same micro-batches
(`train.grad_accum=M`): GPipe and zero-bubble in one process (the test's own), 1F1B as
two processes of one stage each (`launch/local.py -n 2`): each schedule and each way of
running once.
The other two pairs add no code path: a schedule is one SPMD program whichever process
holds a stage's devices (its numbers: `tests/test_pipeline.py`, `test_pipeline_1f1b.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from moe_jax import trainer
from tests.multihost import MODEL, flags, losses, run
from tests.settings import make_config

STEPS = 10
SETTINGS = {
    **MODEL,  # the multi-process tests' small run
    "model.num_layers": 4,  # 2 stages of 2 MoE layers
    "train.eval_every": 5,
    "train.checkpoint_every": 5,
    "parallel.attention": "sp",
    "parallel.experts": "ep_a2a",
    "parallel.intra": 4,
}
PIPELINE = {"parallel.stages": 2, "parallel.microbatches": 4}
ONE_STAGE = {"parallel.data": 2, "train.grad_accum": 4}


def _train(workdir: Path, settings: dict, processes: int = 1) -> dict[int, float]:
    """The run on 8 CPU devices: in this process (which has 8), or as `processes`
    processes of `launch/local.py`."""
    if processes == 1:
        trainer.run(make_config({**settings, "train.steps": STEPS}), workdir)
    else:
        launch = [sys.executable, "launch/local.py", "-n", str(processes), "--devices", "4"]
        command = [*launch, "--", f"--workdir={workdir}", *flags(settings, STEPS)]
        done = run(command, devices=8 // processes)
        assert done.returncode == 0, done.stderr[-3000:]
    got = losses(workdir)
    assert sorted(got) == list(range(1, STEPS + 1))
    return got


@pytest.fixture(scope="module")
def one_stage(tmp_path_factory) -> dict[int, float]:
    return _train(tmp_path_factory.mktemp("one_stage"), {**SETTINGS, **ONE_STAGE})


@pytest.mark.parametrize(
    "processes,schedule",
    [(1, "gpipe"), (2, "1f1b"), (1, "zero_bubble")],
    ids=["one_process", "a_process_per_stage", "zero_bubble"],
)
def test_two_stages_log_the_one_stage_losses(tmp_path, one_stage, processes, schedule):
    settings = {**SETTINGS, **PIPELINE, "parallel.schedule": schedule}
    got = _train(tmp_path / "run", settings, processes)
    steps = sorted(got)
    np.testing.assert_allclose([got[s] for s in steps], [one_stage[s] for s in steps], rtol=1e-5)
    assert (tmp_path / "run" / "checkpoints" / str(STEPS)).is_dir()
