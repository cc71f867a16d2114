"""`python -m moe_jax.evaluate --workdir RUN [--split val] [--batches N] [--config.data.*]`.

Loss and perplexity of a run's newest checkpoint on prepared data, with no training:
its own validation split by default, or any data given as `--config.data.*`
(`source`, `path`) with the batch as `--config.train.batch_size` / `seq_len` and the
plan as `--config.parallel.*`, validated as `train` validates them. Prints one line;
exit status 0, 1 on bad input, 130 on SIGINT or SIGTERM.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from functools import partial
from pathlib import Path

from absl import app, flags

from moe_jax import cli, paths, signals

_CONFIG = cli.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "The run directory whose checkpoint to score.")
_SPLIT = flags.DEFINE_string("split", "val", "Split of the data: val or train.")
_BATCHES = flags.DEFINE_integer("batches", 0, "Batches to score (0: train.eval_batches).")
SECTIONS = ("data", "train", "parallel")


def checked_sections(saved, given: dict, batches: int):
    """(data, train) of the run with the given overrides, validated as `train` validates
    them, or a one-line ValueError naming the setting."""
    from moe_jax import config as config_lib

    data = dataclasses.replace(saved.data, **given["data"])
    train = dataclasses.replace(saved.train, **{**given["train"], "grad_accum": 1})
    candidate = dataclasses.replace(saved, data=data, train=train)
    config_lib.validate(candidate)
    if not batches and train.eval_batches < 1:
        raise ValueError(
            f"train.eval_batches={train.eval_batches} scores nothing; give --batches=N "
            "or --config.train.eval_batches=N (N >= 1)"
        )
    if given["data"].get("path"):
        paths.check_input(data.path, "--config.data.path", "dir")
    return data, train


def score(workdir: Path, given: dict, split: str, batches: int) -> tuple[int, float, int, int]:
    """(checkpoint step, mean loss in nats per token of the main head, tokens scored, the
    run's multi-token prediction modules, which are not scored)."""
    import jax
    import numpy as np

    from moe_jax import saved_run
    from moe_jax.config import ParallelConfig
    from moe_jax.data import pipeline
    from moe_jax.parallel import mesh as mesh_lib
    from moe_jax.train_step import eval_step

    saved = saved_run.saved_config(workdir)
    data, train = checked_sections(saved, given, batches)
    parallel = ParallelConfig(**given["parallel"])
    config, layout, graphdef, step, state = saved_run.restore(
        workdir, parallel, data=data, train=train
    )
    sharding = mesh_lib.batch_sharding(layout)
    t = config.train
    rows = pipeline.local_rows(sharding, t.batch_size, t.seq_len)
    stream = pipeline.make_iterator(config, split, rows, shuffle=False)
    fn = jax.jit(partial(eval_step, graphdef, config))
    count = batches or t.eval_batches
    losses = [
        float(fn(state, pipeline.global_array(next(stream), sharding, t.batch_size)))
        for _ in range(count)
    ]
    return step, float(np.mean(losses)), count * t.batch_size * t.seq_len, config.model.mtp_depth


@signals.interruptible("evaluation")
def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise SystemExit(f"error: unexpected arguments {argv[1:]}")
    if not _WORKDIR.value:
        raise SystemExit("error: evaluate needs --workdir=RUN (a run directory)")
    if _BATCHES.value < 0:
        raise SystemExit(f"error: --batches={_BATCHES.value} must be >= 0")
    if _SPLIT.value not in ("val", "train"):
        raise SystemExit(f"error: --split={_SPLIT.value!r} is invalid; valid: val, train")
    given = cli.overridden(sys.argv, _CONFIG.value, SECTIONS)
    workdir = Path(_WORKDIR.value)
    try:
        paths.check_input(workdir, "--workdir", "dir")
        step, loss, tokens, mtp = score(workdir, given, _SPLIT.value, _BATCHES.value)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    print(
        f"{_SPLIT.value} loss {loss:.4f} nats/token, perplexity {math.exp(loss):.3f} "
        f"({tokens} tokens, step {step} of {workdir}"
        + (f"; main head only, its {mtp} MTP modules not scored)" if mtp else ")")
    )


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse)
