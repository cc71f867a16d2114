"""Document masks (`moe_jax.data.documents`): the batch fields, the blockwise kernel's
skipped blocks, and the acceptance check: two documents packed into one window give
the logits of each document run alone (within 1e-5) under every attention
implementation and layout, and differ from them with data.document_mask=false."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from moe_jax.config import Config, DataConfig, ParallelConfig
from moe_jax.data import pipeline as data_pipeline
from moe_jax.data.documents import document_fields
from moe_jax.data.tokenizer import ByteTokenizer
from moe_jax.kernels import blockwise_attention as bw
from moe_jax.kernels.attention import xla_attention
from moe_jax.model.loss import with_loss_weights
from moe_jax.model.mtp import with_targets
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel import per_device_step, pipeline
from moe_jax.parallel.layout import SINGLE_DEVICE
from moe_jax.plan.resolve import check_plan
from moe_jax.train_state import build_model
from tests.layouts import BASE, MLA

EOS = ByteTokenizer.eos_id
B, S, SPLIT = BASE.train.batch_size, BASE.train.seq_len, 6  # document A: 6 tokens with EOS


def test_fields_by_hand():
    fields = document_fields(np.array([[5, 6, EOS, 7, 8, EOS, EOS, 9]]), EOS)
    assert fields["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 2, 3, 4]]
    assert fields["positions"].tolist() == [[0, 1, 2, 0, 1, 2, 0, 0]]
    # EOS is predicted from its document; the token after it from nothing.
    assert fields["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 0, 0, 1]]


def _config(mask: bool, seq_len: int = 64) -> Config:
    return dataclasses.replace(
        BASE,
        train=dataclasses.replace(BASE.train, seq_len=seq_len),
        data=DataConfig(document_mask=mask),
    )


def test_batches_off_are_todays_and_on_adds_fields():
    """Off: exactly the windows of the stream (today's batches, byte for byte), nothing
    else; on: the same inputs and targets plus the fields of `document_fields`."""
    off, on = _config(False), _config(True)
    tokens, _ = data_pipeline.token_stream(off.data, "val", off.model.vocab_size)
    first = next(data_pipeline.make_iterator(off, "val", shuffle=False))
    window = off.train.seq_len + 1
    want = np.asarray(tokens[: B * window], np.int32).reshape(B, window)
    assert sorted(first) == ["inputs", "targets"]
    assert first["inputs"].tobytes() == want[:, :-1].tobytes()
    assert first["targets"].tobytes() == want[:, 1:].tobytes()
    a, b = (
        next(data_pipeline.make_iterator(off, "val")),
        next(data_pipeline.make_iterator(on, "val")),
    )
    assert a["inputs"].tobytes() == b["inputs"].tobytes()
    assert a["targets"].tobytes() == b["targets"].tobytes()
    for key, value in document_fields(a["inputs"], EOS).items():
        np.testing.assert_array_equal(b[key], value)


def _random_positions(rng, b: int, s: int, mean_length: int) -> np.ndarray:
    inputs = np.where(rng.random((b, s)) < 1 / mean_length, EOS, 1)
    return document_fields(inputs, EOS)["positions"]


def test_blockwise_matches_masked_xla_and_skips_blocks(monkeypatch):
    """In blocks of 4 positions: forward and gradients as XLA's with the same document
    mask; the blocks visited fall with shorter documents."""
    monkeypatch.setattr(bw, "MAX_BLOCK", 4)
    rng = np.random.default_rng(0)
    b, s, h, kv, d = 2, 32, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(b, s, n, d)), jnp.float32) for n in (h, kv, kv))
    positions = jnp.asarray(_random_positions(rng, b, s, 6))
    cot = jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32)

    @jax.jit
    def both(q, k, v, positions):
        def grads(fn):
            out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, positions=positions), q, k, v)
            return out, vjp(cot)

        return grads(bw.blockwise_attention), grads(xla_attention)

    got, want = both(q, k, v, positions)
    for a, b_ in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b_, atol=2e-5, rtol=2e-5)
    causal = bw.visited_blocks(None, 256)  # 64 blocks of 4: 64·65/2
    lengths = (64, 16, 4)
    visits = [bw.visited_blocks(_random_positions(rng, 2, 256, n), 256) for n in lengths]
    assert causal == 64 * 65 // 2 and causal > visits[0] > visits[1] > visits[2], visits


def _packed_batch() -> dict[str, np.ndarray]:
    """Row r: document A (SPLIT tokens ending in EOS) then document B, token ids < 256."""
    rng = np.random.default_rng(1)
    window = rng.integers(0, 256, (B, S + 1)).astype(np.int32)
    window[:, SPLIT - 1] = EOS
    inputs, targets = window[:, :-1], window[:, 1:]
    return {"inputs": inputs, "targets": targets, **document_fields(inputs, EOS)}


@functools.cache
def _alone(base: Config) -> np.ndarray:
    """[B, S, V] logits of documents A and B, each run alone on one device, side by side."""
    graphdef, state = nnx.split(build_model(base))
    inputs = jnp.asarray(_packed_batch()["inputs"])
    run = jax.jit(lambda state, a, b: [nnx.merge(graphdef, state)(x)[0] for x in (a, b)])
    return np.concatenate(run(state, inputs[:, :SPLIT], inputs[:, SPLIT:]), axis=1)


def _logits(config: Config, layout, documents: bool) -> np.ndarray:
    layout = dataclasses.replace(layout, documents=documents)
    graphdef, state = nnx.split(build_model(config, layout))
    batch = _packed_batch()
    positions = jnp.asarray(batch["positions"]) if documents else None
    run = jax.jit(lambda state, x, p: nnx.merge(graphdef, state)(x, p)[0])
    return np.asarray(run(state, jnp.asarray(batch["inputs"]), positions))


def _laid_out(config: Config, **plan):
    config = check_plan(dataclasses.replace(config, parallel=ParallelConfig(**plan)), 8)
    return config, mesh_lib.make_layout(config, mesh_lib.make_mesh(config))


IMPLS = [("xla", BASE), ("blockwise", BASE), ("xla", MLA), ("blockwise", MLA)]


@pytest.mark.parametrize("impl,base", IMPLS, ids=[f"{i}-{b.model.attention}" for i, b in IMPLS])
def test_packed_documents_as_alone_single_device(impl, base):
    config = dataclasses.replace(base, model=dataclasses.replace(base.model, attention_impl=impl))
    want = _alone(base)
    np.testing.assert_allclose(_logits(config, SINGLE_DEVICE, True), want, atol=1e-5, rtol=1e-5)
    if (impl, base) != IMPLS[0]:
        return  # the mask's absence is seen once: the same program for every core
    off = _logits(config, SINGLE_DEVICE, False)
    np.testing.assert_allclose(off[:, :SPLIT], want[:, :SPLIT], atol=1e-5, rtol=1e-5)
    assert np.abs(off[:, SPLIT:] - want[:, SPLIT:]).max() > 1e-3  # B saw A without a mask


LAYOUTS = {
    "dp": dict(attention="dp", data=8),
    "fsdp": dict(attention="fsdp", data=2, intra=4),
    "tp": dict(attention="tp", data=2, intra=4),
    "tp-ring": dict(attention="tp", data=2, intra=4, collective_matmul=True),
    "sp": dict(attention="sp", data=2, intra=4),
    "sp-ring-chunks": dict(
        attention="sp", data=2, intra=4, collective_matmul=True, overlap_chunks=2
    ),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_packed_documents_as_alone_under_layouts(name):
    config, layout = _laid_out(BASE, **LAYOUTS[name])
    want = _alone(BASE)
    np.testing.assert_allclose(_logits(config, layout, True), want, atol=1e-5, rtol=1e-5)


def test_packed_documents_through_a_two_stage_pipeline():
    """The pipelined model's logits (micro-batches through 2 stages, inside the step's
    per-device shard_map) are those of the documents run alone; without the mask the
    second document's are not."""
    config, layout = _laid_out(BASE, attention="dp", data=4, stages=2, microbatches=2)
    batch = _packed_batch()
    want = _alone(BASE)

    def logits(documents: bool) -> np.ndarray:
        here = dataclasses.replace(layout, documents=documents)
        graphdef, params, rest = nnx.split(build_model(config, here), nnx.Param, ...)
        per_device = per_device_step.per_device_graph(graphdef, params, rest)
        given = {k: jnp.asarray(batch[k]) for k in ("inputs", "positions")}
        staged, spec = pipeline.microbatch_major(given, here)

        def body(params, rest, staged):
            local = pipeline.local_batch(staged)
            model = nnx.merge(per_device, params, rest)
            out = model(local["inputs"], local["positions"] if documents else None)[0]
            return out.reshape(staged["inputs"].shape + out.shape[-1:])

        specs = jax.tree.map(lambda s: s.spec, mesh_lib.state_shardings(params, here))
        run = jax.shard_map(
            body,
            mesh=here.mesh,
            in_specs=(specs, jax.tree.map(lambda _: P(), rest), {k: spec for k in given}),
            out_specs=P(*spec, None),
        )
        return np.asarray(jax.jit(run)(params, rest, staged))

    expected = pipeline.microbatch_major({"x": want}, layout)[0]["x"]
    np.testing.assert_allclose(logits(True), expected, atol=1e-5, rtol=1e-5)
    off = logits(False)
    np.testing.assert_allclose(off[..., :SPLIT, :], expected[..., :SPLIT, :], atol=1e-5, rtol=1e-5)
    assert np.abs(off[..., SPLIT:, :] - expected[..., SPLIT:, :]).max() > 1e-3


def test_loss_weights_count_only_targets_within_a_document():
    """The main loss's weights and MTP's per depth, by hand: mask · b·s / count."""
    batch = {"targets": np.zeros((1, 6), np.int32), "loss_mask": np.array([[1, 1, 0, 1, 1, 1]])}
    np.testing.assert_allclose(with_loss_weights(batch)["weights"], [[1.2, 1.2, 0, 1.2, 1.2, 1.2]])
    depth1, depth2 = with_targets(batch, 2)["mtp"]["weights"]
    np.testing.assert_allclose(depth1, [[2, 0, 0, 2, 2, 0]])  # inputs i, i+1 in one document
    np.testing.assert_allclose(depth2, [[0, 0, 0, 6, 0, 0]])  # and i+2, inside the window


def test_a_run_saved_before_document_masks_resumes_without_them(tmp_path):
    """`train --workdir RUN` takes the run's saved settings as its defaults: a config.json
    written before data.document_mask existed resumes with it off, as that run trained
    (its iterator state holds no document fields); one that has it keeps its value."""
    from moe_jax import config as config_lib
    from moe_jax import run_config

    written = config_lib.to_config_dict(config_lib.Config()).to_dict()
    del written["data"]["document_mask"]
    (tmp_path / "config.json").write_text(json.dumps(written))
    assert run_config.saved(tmp_path)["data"]["document_mask"] is False
    written["data"]["document_mask"] = True
    (tmp_path / "config.json").write_text(json.dumps(written))
    assert run_config.saved(tmp_path)["data"]["document_mask"] is True
