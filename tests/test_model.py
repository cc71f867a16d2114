"""The transformer: attention against a naive reference, layer structure, dtypes,
logical axis names, and a tiny model that overfits a fixed batch."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.config import Config, ModelConfig, MoEConfig, TrainConfig
from moe_jax.model.attention import Attention
from moe_jax.model.transformer import Transformer
from moe_jax.train_step import init_state, train_step

LOGICAL_AXES = {
    "layers",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "experts",
    "expert_mlp",
    "vocab",
}


def _naive_attention(x, wq, wk, wv, wo, theta):
    """Causal GQA written out: complex-number rotary, repeated kv heads, explicit softmax."""
    x, wq, wk, wv, wo = (np.asarray(a, np.float64) for a in (x, wq, wk, wv, wo))
    seq = x.shape[1]
    q = np.einsum("bsd,dhk->bshk", x, wq)
    k = np.einsum("bsd,dhk->bshk", x, wk)
    v = np.einsum("bsd,dhk->bshk", x, wv)

    def rope(t):
        half = t.shape[-1] // 2
        angle = np.arange(seq)[:, None] * theta ** (-np.arange(half) / half)
        z = (t[..., :half] + 1j * t[..., half:]) * np.exp(1j * angle)[None, :, None, :]
        return np.concatenate([z.real, z.imag], axis=-1)

    q, k = rope(q), rope(k)
    repeat = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, repeat, axis=2), np.repeat(v, repeat, axis=2)
    scores = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhqs,bshk->bqhk", probs, v)
    return np.einsum("bqhk,hkd->bqd", out, wo)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_attention_matches_naive_gqa(heads: int, kv_heads: int):
    cfg = ModelConfig(embed_dim=24, num_heads=heads, num_kv_heads=kv_heads, head_dim=8)
    attn = Attention(cfg, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(0), (2, 10, 24))
    positions = jnp.broadcast_to(jnp.arange(10), (2, 10))
    got = attn(x, positions)
    want = _naive_attention(
        x, attn.query[...], attn.key[...], attn.value[...], attn.out[...], cfg.rope_theta
    )
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_causality():
    """Changing a later token never changes earlier logits."""
    cfg = Config()
    model = Transformer(cfg.model, cfg.moe, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 16), 0, cfg.model.vocab_size)
    logits, _ = model(tokens)
    changed, _ = model(tokens.at[0, 10].set((tokens[0, 10] + 1) % cfg.model.vocab_size))
    np.testing.assert_allclose(logits[:, :10], changed[:, :10], atol=1e-5)
    assert not np.allclose(logits[:, 10:], changed[:, 10:], atol=1e-5)


def test_dense_prefix_and_moe_every_layout():
    """5 layers = 1 dense + 2 units of (dense, MoE): 2 MoE layers of stats, 'layers' axes."""
    cfg = ModelConfig(num_layers=5, first_k_dense=1, moe_every=2)
    moe = MoEConfig(num_experts=4, top_k=2)
    model = Transformer(cfg, moe, rngs=nnx.Rngs(0))
    _, stats = model(jnp.zeros((2, 8), jnp.int32))
    assert stats.load.shape == (2, 4)
    assert model.dense.units.blocks[0].ffn.gate.shape[0] == 1
    assert model.moe.units.blocks[0].ffn.gate.shape[0] == 2  # the dense block of each unit
    assert model.moe.units.blocks[1].ffn.gate.shape == (2, 4, cfg.embed_dim, moe.expert_mlp_dim)
    np.testing.assert_allclose(stats.load.sum(-1), 2 * 8 * moe.top_k)


def test_scan_keeps_program_size_constant_in_depth():
    """The traced program does not grow with the number of layers (layers are scanned)."""

    def size(num_layers: int) -> int:
        cfg = ModelConfig(num_layers=num_layers, first_k_dense=1)
        model = Transformer(cfg, MoEConfig(), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        forward = lambda state, t: nnx.merge(graphdef, state)(t)
        return len(jax.make_jaxpr(forward)(state, jnp.zeros((1, 8), jnp.int32)).eqns)

    assert size(3) == size(9)


def test_parameters_carry_logical_axis_names():
    cfg = ModelConfig(first_k_dense=1, num_layers=3, tie_embeddings=False)
    model = Transformer(cfg, MoEConfig(num_shared_experts=1), rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    leaves = jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert len(leaves) > 10
    for var in leaves:
        names = var.get_metadata()["out_sharding"]
        assert len(names) == var[...].ndim
        assert set(names) - {None} <= LOGICAL_AXES, names
        assert var[...].dtype == jnp.float32


def test_bfloat16_compute_keeps_float32_params_and_router():
    cfg = Config()
    bf16 = dataclasses.replace(cfg.model, dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.model.vocab_size)
    ref = Transformer(cfg.model, cfg.moe, rngs=nnx.Rngs(0))
    low = Transformer(bf16, cfg.moe, rngs=nnx.Rngs(0))
    ref_logits, _ = ref(tokens)
    logits, stats = low(tokens)
    assert logits.dtype == jnp.float32
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(nnx.state(low, nnx.Param)))
    np.testing.assert_allclose(logits, ref_logits, atol=0.1)
    assert stats.z_loss.dtype == jnp.float32
    hidden = jax.make_jaxpr(lambda t: low(t))(tokens)
    assert "bf16" in str(hidden)


def test_tied_embeddings_share_the_table():
    cfg = dataclasses.replace(Config().model, tie_embeddings=True)
    model = Transformer(cfg, MoEConfig(), rngs=nnx.Rngs(0))
    assert model.head is None
    tokens = jnp.zeros((1, 4), jnp.int32)
    grads = nnx.grad(lambda m: m(tokens)[0][0, -1, 5])(model)
    assert float(jnp.abs(grads.embed.table[...][5]).sum()) > 0  # the head row of token 5


def test_tiny_model_overfits_fixed_batch():
    """2 layers (dense + MoE): loss on one fixed batch falls below 10% of its start."""
    config = Config(
        model=ModelConfig(num_layers=2, first_k_dense=1, embed_dim=64, mlp_dim=128),
        moe=MoEConfig(num_experts=4, top_k=2, expert_mlp_dim=64, bias_update_rate=1e-3),
        train=TrainConfig(steps=200, learning_rate=1e-2, warmup_steps=10, weight_decay=0.0),
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.model.vocab_size, (4, 33)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    graphdef, state = init_state(config)
    step = jax.jit(partial(train_step, graphdef, config))
    losses = []
    for _ in range(config.train.steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["lm_loss"]))
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])
    assert float(jnp.abs(jax.tree.leaves(state.biases)[0]).sum()) > 0  # biases were updated
