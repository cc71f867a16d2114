"""`model.attention_impl`: the blockwise kernel equals XLA's attention, stores memory
linear in the sequence length under every layout that runs it, and a cuDNN request
that cannot run fails in one line before anything compiles (8 forced CPU devices,
see conftest.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from moe_jax.config import Config, ModelConfig
from moe_jax.kernels import blockwise_attention
from moe_jax.kernels.attention import attention_fn, resolve_impl
from moe_jax.model.attention import AXES, AttentionBlock, AttentionWeights, held_axes
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel.layout import SINGLE_DEVICE
from moe_jax.plan import memory
from moe_jax.plan.resolve import check_plan
from tests import layouts
from tests.settings import make_config


def _xla(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _out_and_grads(attend, q, k, v, cotangent):
    """attend(q, k, v) and its vjp of `cotangent`, compiled fast (one program)."""

    def run(q, k, v, cotangent):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(cotangent)

    compiled = jax.jit(run).lower(q, k, v, cotangent).compile(layouts.FAST_COMPILE)
    return compiled(q, k, v, cotangent)


def _qkv(s: int, dtype=jnp.float32, b: int = 2, heads: int = 8, kv_heads: int = 2, d: int = 16):
    keys = jax.random.split(jax.random.key(s), 4)
    shapes = [(b, s, heads, d), (b, s, kv_heads, d), (b, s, kv_heads, d), (b, s, heads, d)]
    return [jax.random.normal(key, shape, dtype) for key, shape in zip(keys, shapes, strict=True)]


def test_block_size_divides_the_sequence():
    assert [blockwise_attention.block_size(s) for s in (16, 512, 1000, 16384, 1031)] == [
        16,
        512,
        500,
        512,
        1,
    ]


@pytest.mark.parametrize("s,max_block", [(16, 512), (40, 16), (48, 16), (1024, 512)])
def test_blockwise_equals_xla_with_gradients(s, max_block, monkeypatch):
    """GQA (8 query heads on 2 kv heads), one block and several (block 10, 16, 512)."""
    monkeypatch.setattr(blockwise_attention, "MAX_BLOCK", max_block)
    q, k, v, cotangent = _qkv(s)
    got = _out_and_grads(blockwise_attention.blockwise_attention, q, k, v, cotangent)
    want = _out_and_grads(_xla, q, k, v, cotangent)
    for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got_leaf, want_leaf, atol=1e-5, rtol=1e-5)


def test_blockwise_in_bfloat16_returns_bfloat16_close_to_float32(monkeypatch):
    monkeypatch.setattr(blockwise_attention, "MAX_BLOCK", 16)
    q, k, v, cotangent = _qkv(64)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v, cotangent)]
    out, grads = _out_and_grads(blockwise_attention.blockwise_attention, *low)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    np.testing.assert_allclose(out.astype(jnp.float32), _xla(q, k, v), atol=3e-2)


# ---------------------------------------------------------------- memory

MEMORY_MODEL = ModelConfig(embed_dim=32, num_heads=8, num_kv_heads=2, head_dim=16)


def _attention_temp_bytes(attention: str, impl: str, s: int) -> int:
    """XLA's temp bytes of forward + backward of one attention block on sequences of `s`
    (one sequence), compiled from abstract inputs, never run. `attention`: 'single'
    (one device) or a layout on the 8 devices, the intra group all of them."""
    if attention == "single":
        layout, shard = SINGLE_DEVICE, lambda spec: None
    else:
        base = Config(model=MEMORY_MODEL, train=layouts.BASE.train)
        config = check_plan(layouts.with_plan(attention, 1, 8, "ep_a2a", base=base), 8)
        layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
        layout = dataclasses.replace(layout, documents=False)  # one sequence, no documents
        shard = functools.partial(NamedSharding, layout.mesh)
    m, spec = MEMORY_MODEL, layout.activation_spec()

    def abstract(shape, names, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=shard(names))

    weights = AttentionWeights(
        query=abstract((m.embed_dim, m.num_heads, m.head_dim), layout.param_spec(AXES.query)),
        key=abstract((m.embed_dim, m.num_kv_heads, m.head_dim), layout.param_spec(AXES.key)),
        value=abstract((m.embed_dim, m.num_kv_heads, m.head_dim), layout.param_spec(AXES.value)),
        out=abstract((m.num_heads, m.head_dim, m.embed_dim), layout.param_spec(AXES.out)),
    )
    x = abstract((1, s, m.embed_dim), spec)
    positions = abstract((1, s), jax.sharding.PartitionSpec(*spec[:2]), jnp.int32)
    block = AttentionBlock(m.rope_theta)
    core = attention_fn(impl, "float32")
    attend = lambda q, k, v, _: core(q, k, v)

    def loss(x, positions, weights):
        out = layout.attention(block, x, positions, weights, held_axes(weights), attend)
        return jnp.sum(out * out)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 2)))
    # Only read: the fast compile's buffer assignment (hence temp bytes) is the same.
    compiled = step.lower(x, positions, weights).compile(layouts.FAST_COMPILE)
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("attention", ["single", "sp", "tp"])
def test_blockwise_attention_memory_grows_linearly_with_the_sequence(attention):
    """8x the sequence: blockwise's temporaries grow at most 9x, XLA's ~64x ([s, s])."""
    growth = {
        impl: _attention_temp_bytes(attention, impl, 16384)
        / _attention_temp_bytes(attention, impl, 2048)
        for impl in ("blockwise", "xla")
    }
    assert growth["blockwise"] <= 9, growth
    assert growth["xla"] > 30, growth


@pytest.mark.parametrize("attention,data,intra", [("dp", 8, 1), ("sp", 1, 8), ("tp", 1, 8)])
def test_memory_model_counts_no_scores_for_flash_attention(attention, data, intra):
    """The planner's stored attention bytes: [s, s] for xla, linear in s otherwise."""

    def scores(impl: str, s: int) -> int:
        config = _with_impl(attention, data, intra, impl)
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, seq_len=s))
        return memory.block_activation_bytes(config, moe=False)["scores"]

    assert scores("blockwise", 16384) == 8 * scores("blockwise", 2048)
    assert scores("auto", 2048) == scores("blockwise", 2048)
    assert scores("xla", 16384) > 60 * scores("xla", 2048)


# ---------------------------------------------------------------- layouts


def _with_impl(attention: str, data: int, intra: int, impl: str) -> Config:
    base = layouts.on_ragged_dot(layouts.BASE)  # attention is the subject, not the experts
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, attention_impl=impl))
    return check_plan(layouts.with_plan(attention, data, intra, "ep_a2a", base=base), 8)


@pytest.mark.parametrize("attention,data,intra", [("sp", 1, 8), ("tp", 2, 4)])
def test_model_step_with_blockwise_equals_xla(attention, data, intra, monkeypatch):
    """Loss, metrics and gradients of the whole model (blocks of 4 of the 16 positions,
    kv heads repeated under sp and sliced under tp)."""
    monkeypatch.setattr(blockwise_attention, "MAX_BLOCK", 4)
    runs = {}
    for impl in ("blockwise", "xla"):
        config = _with_impl(attention, data, intra, impl)
        layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
        runs[impl] = jax.device_get(layouts.loss_and_grads(config, layout))
    layouts.assert_trees_close(runs["blockwise"], runs["xla"], rtol=1e-5)


# ---------------------------------------------------------------- choice and errors


def test_auto_is_cudnn_on_gpu_in_bfloat16_else_blockwise():
    assert resolve_impl("auto", "bfloat16", "gpu") == "cudnn"
    assert resolve_impl("auto", "float32", "gpu") == "blockwise"
    assert resolve_impl("auto", "bfloat16", "cpu") == "blockwise"
    assert resolve_impl("xla", "bfloat16", "gpu") == "xla"


def _one_line_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match) as error:
        call()
    assert "\n" not in str(error.value)


def test_cudnn_that_cannot_run_fails_in_one_line_before_compiling():
    cudnn = make_config(
        {"model.attention_impl": "cudnn", "model.dtype": "bfloat16", "data.document_mask": False}
    )
    _one_line_error(
        lambda: check_plan(cudnn, 8, "cpu"),
        r"model\.attention_impl='cudnn' .*GPU only, not cpu; use 'blockwise', 'xla' or 'auto'",
    )
    check_plan(cudnn, 8, "gpu")
    _one_line_error(lambda: attention_fn("cudnn", "bfloat16", "cpu"), r"GPU only")
    _one_line_error(
        lambda: make_config({"model.attention_impl": "cudnn"}),
        r"model\.attention_impl='cudnn' .*needs model\.dtype='bfloat16'",
    )
    _one_line_error(
        lambda: make_config({"model.attention_impl": "flash"}),
        r"model\.attention_impl='flash' is invalid: valid: \('auto', 'xla', 'cudnn', 'blockwise'\)",
    )
