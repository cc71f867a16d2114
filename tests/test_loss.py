"""The chunked cross-entropy: equal to the plain one, and the full float32 logits never
exist in the compiled program."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from moe_jax.model.loss import auto_chunks, chunked_cross_entropy
from moe_jax.moe.block import RouterBias
from moe_jax.plan.resolve import check_plan
from moe_jax.train_state import build_model
from moe_jax.train_step import loss_fn
from tests.layouts import BASE, assert_trees_close, batch, with_plan
from tests.settings import make_config


def _plain(x, head, targets):
    logits = jnp.einsum("bsd,dv->bsv", x, head, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@pytest.mark.parametrize("chunks", [2, 4, 16])
def test_chunked_equals_plain_with_gradients(chunks: int):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (3, 16, 24))
    head = jax.random.normal(keys[1], (24, 37)) / 5
    targets = jax.random.randint(keys[2], (3, 16), 0, 37)
    got = jax.value_and_grad(partial(chunked_cross_entropy, chunks=chunks), (0, 1))
    want = jax.value_and_grad(_plain, (0, 1))
    (loss, grads), (ref, ref_grads) = got(x, head, targets), want(x, head, targets)
    np.testing.assert_allclose(loss, ref, rtol=1e-6)
    assert_trees_close(grads, ref_grads, rtol=1e-6)


def test_auto_chunks_by_hand():
    assert auto_chunks(16, 128, 259) == 1  # 2 MB of logits: one chunk
    # 8 x 4096 x 32000 float32 = 4.19 GB: 16 chunks of 262 MB fit under 256 MiB.
    assert auto_chunks(8, 4096, 32000) == 16
    # 134 GB would want 512 chunks, but chunks stay at least 64 positions long.
    assert auto_chunks(256, 4096, 32000) == 64


def _grads(config):
    model = build_model(config)
    graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
    fn = jax.jit(
        jax.value_and_grad(partial(loss_fn, graphdef=graphdef, config=config), has_aux=True)
    )
    inputs = batch(config)
    return fn, (params, biases), inputs


def _with_chunks(config, chunks: int):
    return dataclasses.replace(config, train=dataclasses.replace(config.train, loss_chunks=chunks))


def test_model_loss_and_gradients_equal_unchunked_and_no_full_logits():
    config = dataclasses.replace(
        BASE, model=dataclasses.replace(BASE.model, vocab_size=301, tie_embeddings=True)
    )
    results, programs = {}, {}
    for chunks in (1, 4):
        fn, (params, biases), inputs = _grads(_with_chunks(config, chunks))
        (_, metrics), grads = fn(params, biases, batch=inputs)
        results[chunks] = (metrics["lm_loss"], grads)
        programs[chunks] = fn.lower(params, biases, batch=inputs).compile().as_text()
    np.testing.assert_allclose(results[4][0], results[1][0], rtol=1e-6)
    assert_trees_close(results[4][1], results[1][1], rtol=1e-6)
    b, s, v = config.train.batch_size, config.train.seq_len, config.model.vocab_size
    full = f"f32[{b},{s},{v}]"
    assert full in programs[1]  # the plain loss holds them: the check can see them
    assert full not in programs[4] and f"f32[{b},{s // 4},{v}]" in programs[4]


def test_chunked_loss_under_sequence_parallel_attention():
    """sp splits the sequence over 4 devices; strided chunks keep every device's share.
    (Experts by ragged_dot, tests.layouts.on_ragged_dot: the loss is the subject, and the
    unchunked program is test_grad_exchange's.)"""
    from tests.layouts import on_ragged_dot, planned

    config = with_plan("sp", 2, 4, "ep_a2a", base=on_ragged_dot(BASE))
    plain, chunked = planned(config), planned(_with_chunks(config, 4))
    np.testing.assert_allclose(chunked.metrics["lm_loss"], plain.metrics["lm_loss"], rtol=1e-6)
    assert_trees_close(chunked.grads, plain.grads, rtol=1e-5)
    count = lambda hlo, kind: hlo.count(f" {kind}(")
    for kind in ("all-gather", "all-to-all", "collective-permute"):
        assert count(chunked.hlo, kind) == count(plain.hlo, kind), kind


def test_bad_chunk_settings_are_one_line():
    with pytest.raises(ValueError, match=r"train.loss_chunks=3 is invalid"):
        make_config({"train.seq_len": 16, "train.loss_chunks": 3})
    config = _with_chunks(with_plan("sp", 2, 4, "ep_a2a"), 8)  # 2 positions a chunk, 4 shards
    with pytest.raises(ValueError, match=r"train.loss_chunks=8 leaves chunks of 2"):
        check_plan(config, jax.device_count())
