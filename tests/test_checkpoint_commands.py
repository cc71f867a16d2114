"""The commands on a checkpoint: decoding with a KV cache equals the full forward
pass (on one device and under sp + ep_a2a); `sample` and `evaluate` through the real
command line."""

from __future__ import annotations

import json
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax import config as config_lib
from moe_jax import saved_run
from moe_jax.model import decode
from moe_jax.parallel.layout import SINGLE_DEVICE
from moe_jax.train_step import abstract_state
from tests.commands import ROOT, run_command
from tests.test_init_from import _saved_run

MODEL = config_lib.Config(
    model=config_lib.ModelConfig(
        num_layers=3, first_k_dense=1, embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8,
        mlp_dim=48, qkv_bias=True, qk_norm="head",
    ),
    moe=config_lib.MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=16),
    train=config_lib.TrainConfig(batch_size=8, seq_len=16),
)  # fmt: skip
SP_EP = config_lib.ParallelConfig(attention="sp", experts="ep_a2a", data=2, intra=4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """MODEL freshly initialised and saved as a run, once for both plans."""
    workdir = tmp_path_factory.mktemp("saved") / "run"
    _saved_run(MODEL, workdir)
    return workdir


@pytest.mark.parametrize("parallel", [config_lib.ParallelConfig(), SP_EP], ids=["dp", "sp+ep_a2a"])
def test_decoding_with_the_cache_gives_the_full_forward_logits(saved, parallel):
    """A 10-token prompt in one pass, then 6 tokens one at a time: every position's
    logits equal the model's own forward pass over all 16 (parameters placed by the
    plan; the reference is the trained layout's forward)."""
    config, layout, graphdef, _, state = saved_run.restore(saved, parallel)
    tokens = np.random.default_rng(0).integers(0, 259, (8, 16)).astype(np.int32)
    placed = jax.device_put(
        tokens, jax.sharding.NamedSharding(layout.mesh, layout.activation_spec(2))
    )
    want = np.asarray(
        jax.jit(lambda t: nnx.merge(graphdef, state.params, state.biases)(t)[0])(placed)
    )
    single, _ = abstract_state(config, SINGLE_DEVICE)
    forward = jax.jit(lambda p, b, *a: decode.forward(nnx.merge(single, p, b), *a))
    cache = decode.empty_cache(nnx.merge(single, state.params, state.biases), 8, 16)
    logits, cache = forward(state.params, state.biases, jnp.asarray(tokens[:, :10]), cache, 0)
    got = [np.asarray(logits)]
    for i in range(10, 16):
        logits, cache = forward(
            state.params, state.biases, jnp.asarray(tokens[:, i : i + 1]), cache, i
        )
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, rtol=1e-4, atol=1e-4)


def test_top_p_keeps_the_smallest_set_holding_p():
    """Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two, never others."""
    logits = jnp.log(jnp.array([[0.15, 0.5, 0.05, 0.3]]))
    keys = jax.random.split(jax.random.key(0), 400)
    picks = np.array([int(decode.next_token(logits, k, 1.0, 0.7)[0]) for k in keys])
    assert set(picks) == {1, 3}
    assert 0.55 < np.mean(picks == 1) < 0.70  # 0.5 / 0.8 = 0.625
    assert int(decode.next_token(logits, keys[0], 0.0, 1.0)[0]) == 1  # greedy


def _command(command: str, *args: str) -> subprocess.CompletedProcess:
    """`command` (of `tests.commands`) from the repository root, forked from the warm
    interpreter: the command lines themselves run as real subprocesses in
    test_bad_inputs, and the run they read is conftest's `default_run`, typed as a user
    types it."""
    return run_command(ROOT, command, list(args), timeout=600, warm=True)


@pytest.fixture(scope="module")
def trained(default_run):
    """The default config's run (configs/default.py, the embedded corpus)."""
    assert default_run.returncode == 0, default_run.stderr[-3000:]
    return default_run.workdir


def test_sample_writes_python_looking_text_that_differs_across_seeds(trained):
    texts = []
    for seed in (0, 1):
        run = _command(
            "sample", f"--workdir={trained}", "--prompt=def ",
            "--max_new_tokens=120", f"--seed={seed}",
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        texts.append(run.stdout)
    for text in texts:
        assert text.startswith("def ")
        printable = sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in text)
        assert printable / len(text) > 0.9, text
        assert sum(c in " \n" for c in text) / len(text) > 0.1, text  # words and lines
    assert texts[0] != texts[1]


def test_evaluate_scores_the_checkpoint_as_the_run_did_and_other_data(trained, tmp_path):
    """Its own validation split gives the run's last logged val_loss; prepared token
    files give another, finite loss."""
    run = _command("evaluate", f"--workdir={trained}")
    assert run.returncode == 0, run.stderr[-3000:]
    loss = float(re.search(r"val loss ([0-9.]+) nats/token", run.stdout)[1])
    rows = [json.loads(line) for line in (trained / "metrics.jsonl").open()]
    assert loss == pytest.approx([r["val_loss"] for r in rows if "val_loss" in r][-1], abs=1e-4)
    assert "perplexity" in run.stdout and "step 200 of" in run.stdout
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i}: for x in range({i}): print(x)\n" for i in range(400)))
    prepared = _command("prepare", f"--input={text}", f"--output={tmp_path / 'data'}")
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    other = _command(
        "evaluate", f"--workdir={trained}", "--config.data.source=tokens",
        f"--config.data.path={tmp_path / 'data'}", "--batches=2",
    )  # fmt: skip
    assert other.returncode == 0, other.stderr[-3000:]
    other_loss = float(re.search(r"val loss ([0-9.]+) nats/token", other.stdout)[1])
    assert np.isfinite(other_loss) and other_loss != pytest.approx(loss, abs=1e-3)
