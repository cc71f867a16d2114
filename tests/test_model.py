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
from moe_jax.optimizer import rates
from moe_jax.train_state import init_state
from moe_jax.train_step import train_step

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


def _naive_attention(x, wq, wk, wv, wo, theta, biases=None, norms=None, eps=1e-6):
    """Causal GQA written out: complex-number rotary, repeated kv heads, explicit softmax.
    `biases` (q, k, v: [heads, head_dim]) are added after the projections; `norms`
    (q, k scales) RMS-normalise each head ([head_dim]) or the whole projection
    ([heads, head_dim]) before the rotary."""
    x, wq, wk, wv, wo = (np.asarray(a, np.float64) for a in (x, wq, wk, wv, wo))
    seq = x.shape[1]
    q = np.einsum("bsd,dhk->bshk", x, wq)
    k = np.einsum("bsd,dhk->bshk", x, wk)
    v = np.einsum("bsd,dhk->bshk", x, wv)
    if biases is not None:
        q, k, v = (t + np.asarray(b, np.float64) for t, b in zip((q, k, v), biases, strict=True))

    def rms(t, scale):
        scale = np.asarray(scale, np.float64)
        flat = t.reshape(*t.shape[:2], -1) if scale.ndim == 2 else t
        flat = flat / np.sqrt(np.mean(flat**2, axis=-1, keepdims=True) + eps)
        return flat.reshape(t.shape) * scale

    if norms is not None:
        q, k = rms(q, norms[0]), rms(k, norms[1])

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


def _randomise(param: nnx.Param, seed: int) -> jax.Array:
    """Overwrites a zero bias or unit scale with random values, so a bias or norm left
    out, swapped or applied in the wrong place changes the output."""
    value = 1.0 + jax.random.normal(jax.random.key(seed), param[...].shape)
    param[...] = value
    return value


@pytest.mark.parametrize(
    "qkv_bias,qk_norm", [(True, "none"), (False, "head"), (False, "projection"), (True, "head")]
)
def test_attention_biases_and_qk_norms_match_naive(qkv_bias: bool, qk_norm: str):
    """Qwen2's q/k/v biases, Qwen3's per-head and OLMoE's per-projection q/k RMSNorm,
    against the written-out block (head_dim 6 != embed / heads, 5 heads over 1 kv head)."""
    cfg = ModelConfig(
        embed_dim=20, num_heads=5, num_kv_heads=1, head_dim=6, qkv_bias=qkv_bias, qk_norm=qk_norm
    )
    attn = Attention(cfg, rngs=nnx.Rngs(4))
    x = jax.random.normal(jax.random.key(1), (2, 9, 20))
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    biases = norms = None
    if qkv_bias:
        biases = [
            _randomise(p, i)
            for i, p in enumerate((attn.query_bias, attn.key_bias, attn.value_bias))
        ]
    if qk_norm != "none":
        norms = [
            _randomise(n.scale, 10 + i) for i, n in enumerate((attn.query_norm, attn.key_norm))
        ]
        assert norms[0].shape == ((6,) if qk_norm == "head" else (5, 6))
    got = attn(x, positions)
    weights = (attn.query[...], attn.key[...], attn.value[...], attn.out[...])
    want = _naive_attention(x, *weights, cfg.rope_theta, biases, norms, cfg.norm_eps)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    plain = _naive_attention(x, *weights, cfg.rope_theta)
    assert not np.allclose(got, plain, atol=1e-3)  # the feature changes the block


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
    for lr in rates(config.train):
        state, metrics = step(state, batch, lr)
        losses.append(float(metrics["lm_loss"]))
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])
    assert float(jnp.abs(jax.tree.leaves(state.biases)[0]).sum()) > 0  # biases were updated
