"""Multi-token prediction (`moe_jax.model.mtp`): the loss at depth 1 against a
written-out computation from the model's own parameters, the MTP term's gradients on
the shared embedding and head, two 8-device layouts (vocabulary-parallel and chunked
loss on one) and a 2-stage pipeline against one device."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from moe_jax.model.layers import rms_norm
from moe_jax.moe.block import RouterBias
from moe_jax.parallel import pipeline
from moe_jax.train_state import build_model
from moe_jax.train_step import loss_fn
from tests.layouts import (
    FAST_COMPILE,
    assert_trees_close,
    batch,
    on_ragged_dot,
    planned,
    reference,
    with_plan,
)
from tests.pipelined import MODEL, one_device, pipelined


def _mtp(config, depth: int, **train):
    """`config` with `depth` MTP modules (and `train` settings)."""
    model = dataclasses.replace(config.model, mtp_depth=depth)
    return dataclasses.replace(
        config, model=model, train=dataclasses.replace(config.train, **train)
    )


# The pipeline tests' model (a dense first layer, four MoE layers, aux and sequence aux
# losses, bias updates) with vocabulary 256 (intra 4 divides it) and two MTP modules
# (MoE blocks, as layers 5 and 6 would be), accumulating M = 4 micro-batches: the one
# single-device reference of every multi-device test here. Experts run ragged_dot
# (tests.layouts.on_ragged_dot): MTP, not the expert kernel, is the subject.
BASE = _mtp(
    on_ragged_dot(
        dataclasses.replace(one_device(4), model=dataclasses.replace(MODEL.model, vocab_size=256))
    ),
    2,
    mtp_loss_weight=0.3,
)


def _written_out(model, inputs, targets, weight: float):
    """loss = lm + weight * CE_1 for depth 1, written out in plain jnp from the model's
    parameters: HF's eh_proj [d, 2d] applied to [enorm(Emb(t_{i+1})); hnorm(h_i)] with
    the embedding half first, the model's block, its own norm, the shared head, the
    mean over the positions whose target t_{i+2} exists."""
    cfg = model.cfg
    h, _ = model.features(inputs)  # the main stack after its final norm
    head = model.head[...]
    logits = lambda x: jnp.einsum("bsd,dv->bsv", x, head)
    ce = optax.softmax_cross_entropy_with_integer_labels
    lm = ce(logits(h), targets).mean()
    layer = model.mtp.layers[0]
    eh = layer.eh_proj[...].T  # as Hugging Face stores eh_proj.weight: [d, 2d]
    e = model.embed.table[...][targets]  # Emb(t_{i+1}) at position i
    d = cfg.embed_dim
    en = rms_norm(e, layer.enorm.scale[...], cfg.norm_eps)
    hn = rms_norm(h, layer.hnorm.scale[...], cfg.norm_eps)
    joined = en @ eh[:, :d].T + hn @ eh[:, d:].T
    s = inputs.shape[1]
    positions = jnp.broadcast_to(jnp.arange(s), inputs.shape)
    out, _ = layer.block(joined, positions)
    x = rms_norm(out, layer.norm.scale[...], cfg.norm_eps)
    per_token = ce(logits(x)[:, : s - 1], targets[:, 1:])  # t_{i+2} = targets[i + 1]
    return lm + weight * per_token.mean(), lm, per_token.mean()


def _split_model(config):
    """(graphdef, params, biases) of `config`'s model, initialised by one jitted call."""
    graphdef = nnx.split(nnx.eval_shape(lambda: build_model(config)), nnx.Param, RouterBias)[0]
    states = jax.jit(lambda: nnx.split(build_model(config), nnx.Param, RouterBias)[1:])()
    return graphdef, *states


def test_depth_one_loss_equals_written_out_and_its_gradients_reach_embedding_and_head():
    config = _mtp(BASE, 1)
    graphdef, params, biases = _split_model(config)
    data = batch(config)

    def parts(params):
        _, metrics = loss_fn(params, biases, graphdef, data, config)
        return metrics["mtp_loss"], metrics

    def both(params):
        model = nnx.merge(graphdef, params, biases)
        want = _written_out(model, jnp.asarray(data["inputs"]), data["targets"], 0.3)
        return jax.value_and_grad(parts, has_aux=True)(params), want

    compiled = jax.jit(both).lower(params).compile(compiler_options=FAST_COMPILE)
    ((mtp_loss, metrics), grads), (total, lm, ce1) = compiled(params)
    np.testing.assert_allclose(metrics["lm_loss"], lm, rtol=1e-5)
    np.testing.assert_allclose(mtp_loss, ce1, rtol=1e-5)
    # the MoE terms are those of every MoE layer, the MTP block's included
    moe = config.moe
    router = sum(
        getattr(moe, f"{name}_coef") * metrics[name]
        for name in ("aux_loss", "seq_aux_loss", "z_loss")
    )
    np.testing.assert_allclose(metrics["loss"] - router, total, rtol=1e-5)
    assert metrics["mtp_load"].shape == (1, moe.num_experts)
    assert float(metrics["mtp_load"].sum()) == data["inputs"].size * moe.top_k
    # The MTP term alone moves the shared embedding and head, and the main stack
    # through h^0 (its input), not only the MTP module's own weights.
    for name in ("embed", "head", "final_norm", "dense", "moe", "mtp"):
        leaves = jax.tree.leaves(grads[name])
        assert max(float(jnp.abs(g).max()) for g in leaves) > 1e-6, name


def _vocab_parallel(config):
    return dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, vocab_parallel=True)
    )


LAYOUTS = {
    # sequence-parallel attention, vocabulary-parallel embedding, head and loss in 2 chunks
    "sp+ep_a2a,vocab_parallel,2_chunks": _vocab_parallel(
        with_plan("sp", 2, 4, "ep_a2a", base=_mtp(BASE, 2, loss_chunks=2))
    ),
    "tp+etp": with_plan("tp", 2, 4, "etp", base=BASE),
}


def _assert_equal(run, ref, canonical=lambda tree: tree) -> None:
    for name in ("loss", "lm_loss", "mtp_loss", "aux_loss", "z_loss"):
        np.testing.assert_allclose(run.metrics[name], ref.metrics[name], rtol=1e-5, err_msg=name)
    np.testing.assert_array_equal(run.metrics["mtp_load"], ref.metrics["mtp_load"])
    assert_trees_close(canonical(run.grads), ref.grads, rtol=1e-5)
    after = jax.device_get(canonical(run.state.params))
    assert_trees_close(after, jax.device_get(ref.state.params), rtol=1e-5)
    assert_trees_close(jax.device_get(run.state.biases), jax.device_get(ref.state.biases), 1e-5)


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_equals_one_device(name):
    _assert_equal(planned(LAYOUTS[name]), reference(BASE))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stage_pipeline_equals_one_stage(schedule):
    """2 stages, 4 micro-batches: under GPipe each stage runs its 2 micro-batches' MTP
    modules one at a time after the pipeline, under 1F1B the last stage runs each
    micro-batch's after its head inside the loop (MoE aux losses are per micro-batch
    either way), against one device accumulating the same 4 micro-batches."""
    plan = dataclasses.replace(pipelined(2, 1, 4, 4).parallel, schedule=schedule)
    train = dataclasses.replace(BASE.train, grad_accum=1)
    run = planned(dataclasses.replace(BASE, train=train, parallel=plan))
    ref = reference(BASE)
    np.testing.assert_array_equal(run.metrics["load"], ref.metrics["load"])
    _assert_equal(run, ref, pipeline.canonical)
