"""`python -m moe_jax.train [--config=configs/<name>.py] [--config.<a>.<b>=<v> ...]`.

For now this is the minimal training loop on synthetic tokens (the full
trainer, with real data, checkpoints and metrics files, is the next step).
"""

from __future__ import annotations

import time
from functools import partial

import jax
from absl import app
from ml_collections import config_flags

from moe_jax import config as config_lib
from moe_jax.data import synthetic
from moe_jax.flops import flops_per_token
from moe_jax.train_step import init_state, train_step

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Config file.")


def train(config: config_lib.Config, log=print) -> list[dict[str, float]]:
    """Trains `config.train.steps` steps on synthetic tokens; returns the logged rows."""
    tc = config.train
    graphdef, state = init_state(config)
    step_fn = jax.jit(partial(train_step, graphdef, config), donate_argnums=0)
    data = synthetic.batches(tc.batch_size, tc.seq_len, config.model.vocab_size, tc.seed)
    tokens_per_step = tc.batch_size * tc.seq_len
    flops = flops_per_token(config.model, config.moe, tc.seq_len) * tokens_per_step
    rows, start = [], time.perf_counter()
    for step in range(1, tc.steps + 1):
        state, metrics = step_fn(state, next(data))
        if step % tc.log_every == 0 or step == tc.steps:
            loss = float(metrics["loss"])
            elapsed = time.perf_counter() - start
            row = {"step": step, "loss": loss, "lm_loss": float(metrics["lm_loss"])}
            row["tokens_per_sec"] = tokens_per_step * tc.log_every / elapsed
            row["model_tflops_per_sec"] = flops * tc.log_every / elapsed / 1e12
            rows.append(row)
            log(
                " ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                )
            )
            start = time.perf_counter()
    return rows


def main(argv: list[str]) -> None:
    del argv
    try:
        config = config_lib.load(_CONFIG.value)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    print("moe_jax: minimal training loop on synthetic tokens (the full trainer comes next).")
    train(config)


if __name__ == "__main__":
    app.run(main)
