"""Loss curves of the default config with and without compressed exchanges, or under
AdamW and Muon.

    python bench/convergence.py [--steps 400] [--out docs/compression_loss.png]
    python bench/convergence.py --compare=optimizer [--steps 200] [--out docs/optimizer_loss.png]
    python bench/convergence.py --small      # a quick dry run (10 steps)

`--compare=compression` (the default) trains `configs/default.py` on the embedded corpus
three times on 8 CPU devices under sp + ep_a2a (n=4, data=2):
  (a) float32 gradient exchange            parallel.grad_exchange=fp32
  (b) bf16 all-to-all, float32 sums        parallel.grad_exchange=bf16_a2a
  (c) as (b), with FP8 token exchange      + parallel.token_dtype=fp8
`--compare=optimizer` trains the default run (its own plan) three times:
  (a) adamw at the default learning rate   train.learning_rate=3e-3
  (b) adamw at twice it                    train.learning_rate=6e-3 (AdamW's best of
                                           3e-3, 6e-3 and 1.2e-2 at 200 steps)
  (c) muon                                 train.optimizer=muon, learning_rate=1.2e-2
each through the real command line (`python -m moe_jax.train`) in its own run
directory, and draws the training-loss curves in one PNG. Prints one JSON object
last: each run's final validation loss and its ratio to (a). Nothing here is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
PLAN = {
    "parallel.attention": "sp",
    "parallel.experts": "ep_a2a",
    "parallel.intra": 4,
    "parallel.data": 2,
}
# Per comparison: (the runs' shared settings, each run's own, the title, default steps)
COMPARISONS = {
    "compression": (
        PLAN,
        {
            "(a) fp32": {},
            "(b) bf16_a2a": {"parallel.grad_exchange": "bf16_a2a"},
            "(c) bf16_a2a + fp8 tokens": {
                "parallel.grad_exchange": "bf16_a2a",
                "parallel.token_dtype": "fp8",
            },
        },
        "sp+ep_a2a, n=4, data=2",
        400,
    ),
    "optimizer": (
        {},
        {
            "(a) adamw, lr 3e-3 (the default)": {},
            "(b) adamw, lr 6e-3": {"train.learning_rate": 6e-3},
            "(c) muon, lr 1.2e-2": {"train.optimizer": "muon", "train.learning_rate": 1.2e-2},
        },
        "the default run under AdamW and Muon",
        200,
    ),
}


def train(workdir: Path, steps: int, shared: dict, settings: dict) -> list[dict]:
    """One run of the trainer's command line; its metrics rows."""
    overrides = {**shared, **settings, "train.steps": steps, "train.eval_every": 0}
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    command = [sys.executable, "-m", "moe_jax.train", f"--workdir={workdir}", *flags]
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="compression")
    parser.add_argument("--steps", type=int, default=0, help="0: the comparison's own")
    parser.add_argument("--out", type=Path, default=None, help="default docs/<compare>_loss.png")
    parser.add_argument("--small", action="store_true", help="10 steps, for a dry run")
    args = parser.parse_args()
    shared, runs, title, default_steps = COMPARISONS[args.compare]
    steps = 10 if args.small else args.steps or default_steps
    out = args.out or ROOT / "docs" / f"{args.compare}_loss.png"
    results, curves = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, settings in runs.items():
            rows = train(Path(tmp) / str(len(results)), steps, shared, settings)
            curves[name] = [(r["step"], r["loss"]) for r in rows if "loss" in r]
            results[name] = [r["val_loss"] for r in rows if "val_loss" in r][-1]
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        axes.plot(*zip(*curve, strict=True), label=name, linewidth=1)
    axes.set(xlabel="step", ylabel="training loss", title=title)
    axes.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100, bbox_inches="tight")
    base = next(iter(results.values()))
    ratios = {name: val / base for name, val in results.items()}
    print(json.dumps({"steps": steps, "val_loss": results, "ratio_to_a": ratios}))


if __name__ == "__main__":
    main()
