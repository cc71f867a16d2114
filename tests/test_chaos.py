"""Chaos: a run on a 3-source mixture (`data.sources`) SIGKILLed at 20 points of a
seeded random schedule (during steps, in the middle of a metrics line, during
evaluation, while a checkpoint's data files are written, and before each rename that
publishes a checkpoint), restarted after each kill, ends with the same parameters and
the same logged losses (per-source validation losses and epochs included), bit for
bit, as a run that was never interrupted."""

from __future__ import annotations

import random
from pathlib import Path

import jax
import numpy as np

from moe_jax.checkpoint import Checkpointer
from moe_jax.data import prepare
from moe_jax.data.corpus import stdlib_documents
from moe_jax.metrics import read_rows
from tests import warm
from tests.test_trainer import ROOT, TINY, _env, _final_params, _train_cli, tiny_config

STEPS, EVERY_CHECKPOINT, EVERY_EVAL = 60, 5, 7
SOURCES = {"web": 3, "code": 2, "math": 1}  # name: weight; math is small and wraps
SETTINGS = [
    *TINY,
    f"--config.train.steps={STEPS}",
    f"--config.train.checkpoint_every={EVERY_CHECKPOINT}",
    f"--config.train.eval_every={EVERY_EVAL}",
    "--config.data.source=tokens",
]
KINDS = ["step", "metrics_line", "eval", "checkpoint_data", "checkpoint_rename"]
LOGGED = (
    *("loss", "lm_loss", "aux_loss", "seq_aux_loss", "z_loss", "grad_norm", "lr", "val_loss"),
    *(f"val_loss/{name}" for name in SOURCES),
    *(f"epochs/{name}" for name in SOURCES),
)


def _mixture(root: Path) -> str:
    """`--config.data.sources=...` of three small byte-tokenised directories of the stdlib
    corpus's files (every third file each; math only 1.2 KB, so it wraps in the run)."""
    documents = stdlib_documents("train", 0.05)
    entries = []
    for i, (name, weight) in enumerate(SOURCES.items()):
        text = "\n".join(documents[i::3])[: 1200 if name == "math" else 40000]
        (root / f"{name}.txt").write_text(text)
        assert (
            prepare.main(["--input", str(root / f"{name}.txt"), "--output", str(root / name)]) == 0
        )
        entries.append(f"{root / name}:{weight}:{name}")
    return f"--config.data.sources={','.join(entries)}"


def _reached(resumed: int, kind: str, last: int) -> int:
    """How often a run resumed at step `resumed` reaches a point of `kind` by step `last`."""
    steps = range(resumed + 1, last + 1)
    evals = sum(1 for s in steps if s % EVERY_EVAL == 0 or s == STEPS)
    saves = sum(1 for s in steps if s % EVERY_CHECKPOINT == 0 or s == STEPS)
    return {
        "step": len(steps),
        "metrics_line": len(steps) + evals,
        "eval": evals,
        "checkpoint_data": saves,
        "checkpoint_rename": 4 * saves,  # config, data and state items, then the step
    }[kind]


def _schedule(seed: int = 0) -> list[tuple[str, int, int]]:
    """20 kills: four of each kind in a seeded order, at seeded steps spread over the
    run (in order), with a seeded choice of which of a checkpoint's renames."""
    rng = random.Random(seed)
    kinds = KINDS * 4
    rng.shuffle(kinds)
    targets = sorted(rng.randint(1, STEPS) for _ in kinds)
    return [(kind, target, rng.randint(1, 4)) for kind, target in zip(kinds, targets, strict=True)]


def _nth(kind: str, resumed: int, target: int, rename: int) -> int:
    """Which occurrence of `kind` to kill at: at step `target`, or the first after it."""
    target = max(target, resumed + 1)
    before = _reached(resumed, kind, target - 1)
    n = {"step": 1, "metrics_line": 1, "eval": 1, "checkpoint_data": 1}.get(kind, rename)
    return min(before + n, _reached(resumed, kind, STEPS))


def _resumes_at(run: Path) -> int:
    checkpoints = Checkpointer(run / "checkpoints", 3)
    steps = checkpoints.steps()
    checkpoints.close()
    return steps[0] if steps else 0


def _logged(run: Path) -> list[tuple]:
    rows = read_rows(run / "metrics.jsonl")
    return [(row["step"], *(row.get(key) for key in LOGGED)) for row in rows]


def test_twenty_kills_change_nothing(tmp_path: Path):
    settings = [*SETTINGS, _mixture(tmp_path)]
    straight = tmp_path / "straight"
    done = _train_cli(straight, *settings, warm=True)
    assert done.returncode == 0, done.stderr[-3000:]

    run, kills = tmp_path / "chaos", []
    for kind, target, rename in _schedule():
        resumed = _resumes_at(run) if run.exists() else 0
        n = _nth(kind, resumed, target, rename)
        kills.append(f"{kind} #{n} from step {resumed} (target step {target})")
        chaos = ["tests/chaos.py", kind, str(n), f"--workdir={run}", *settings]
        killed = warm.run(ROOT, chaos, _env(), timeout=300)
        assert killed.returncode == -9, (kills, killed.stderr[-3000:])
    done = _train_cli(run, *settings, warm=True)
    assert done.returncode == 0, (kills, done.stderr[-3000:])

    logged = _logged(straight)
    assert _logged(run) == logged, kills  # every logged loss, bit for bit
    assert max(row[-1] or 0 for row in logged) > 1, logged[-2:]  # math wrapped
    assert sum(row[LOGGED.index("val_loss/math") + 1] is not None for row in logged) == 9
    config = tiny_config()
    want, got = _final_params(straight, config), _final_params(run, config)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len({kill.split()[0] for kill in kills}) == len(KINDS)
    print("kills:", "; ".join(kills))
