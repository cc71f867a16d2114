"""`train.init_from` (a fresh run from another run's weights) and `train.upcycle`
(dense -> MoE): the upcycled model computes exactly the dense model where the
construction is exact, and both start real runs from the command line."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import jax
import numpy as np
import pytest
from flax import nnx

from moe_jax import config as config_lib
from moe_jax import init_from, saved_run
from moe_jax.checkpoint import Checkpointer
from moe_jax.convert.hf_import import param_paths
from moe_jax.parallel import pipeline
from moe_jax.train_step import init_program
from tests.commands import ROOT, run_command
from tests.test_trainer import TINY

DENSE = config_lib.Config(
    model=config_lib.ModelConfig(
        vocab_size=259, num_layers=3, embed_dim=24, num_heads=4, num_kv_heads=2, head_dim=6,
        mlp_dim=40, first_k_dense=3,
    ),
    train=config_lib.TrainConfig(batch_size=8, seq_len=16),
)  # fmt: skip
# (upcycle, moe settings) of the exact constructions: `copy` with renormalised weights;
# `split` of the width 40 into g = 4 slices of 10, 8 experts = 2 copies, the top 4 (one
# whole copy) renormalised and scaled by g. The first layer stays dense.
EXACT = {
    "copy": dict(num_experts=4, top_k=2, expert_mlp_dim=40),
    "split": dict(num_experts=8, top_k=4, expert_mlp_dim=10, routed_scaling=4.0),
}


def _fresh(config: config_lib.Config):
    """(config, layout, graphdef, a freshly initialised state) under config's plan."""
    config, layout, graphdef, like = saved_run.placed(config, config.parallel)
    return config, layout, graphdef, init_program(config, layout, _shardings(like))()


def _shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def _saved_run(config: config_lib.Config, workdir) -> None:
    """`config` freshly initialised, saved as a run at step 0 (as a run writes it)."""
    config, _, _, state = _fresh(config)
    checkpoints = Checkpointer(workdir / "checkpoints", 1)
    checkpoints.save(0, state, {}, dataclasses.asdict(config))
    checkpoints.close()
    (workdir / "config.json").write_text(json.dumps(dataclasses.asdict(config)))


def _logits(graphdef, params, biases, tokens) -> np.ndarray:
    model = nnx.merge(graphdef, params, biases)
    return np.asarray(jax.jit(lambda t: model(t)[0])(tokens))


def _dense_logits(source, tokens) -> np.ndarray:
    _, _, graphdef, _, state = saved_run.restore(source, DENSE.parallel)
    return _logits(graphdef, state.params, state.biases, tokens)


def _upcycled(source, moe: config_lib.MoEConfig, upcycle: str):
    """(graphdef, params, biases) of a 3-layer model (first layer dense) upcycled from
    the run in `source`."""
    model = dataclasses.replace(DENSE.model, first_k_dense=1)
    train = dataclasses.replace(DENSE.train, init_from=str(source), upcycle=upcycle)
    config = dataclasses.replace(DENSE, model=model, moe=moe, train=train)
    init_from.check(config)
    config, layout, graphdef, fresh = _fresh(config)
    return graphdef, init_from.initial_params(config, layout, fresh.params), fresh.biases


TOKENS = np.random.default_rng(0).integers(0, 259, (8, 16)).astype(np.int32)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """(a saved DENSE run at step 0, its logits on TOKENS), made once for the upcycling
    tests that read it."""
    workdir = tmp_path_factory.mktemp("dense") / "dense"
    _saved_run(DENSE, workdir)
    return workdir, _dense_logits(workdir, TOKENS)


@pytest.mark.parametrize("upcycle", sorted(EXACT))
def test_upcycled_model_computes_the_dense_model_exactly(dense, upcycle: str):
    source, dense_logits = dense
    moe = config_lib.MoEConfig(**EXACT[upcycle])
    graphdef, params, biases = _upcycled(source, moe, upcycle)
    got = _logits(graphdef, params, biases, TOKENS)
    np.testing.assert_allclose(got, dense_logits, rtol=1e-5, atol=1e-5)
    flat = param_paths(params)
    assert flat["moe/units/blocks/0/ffn/gate"].shape == (2, moe.num_experts, 24, moe.expert_mlp_dim)
    router = np.asarray(flat["moe/units/blocks/0/ffn/router"])
    copies = moe.num_experts * moe.expert_mlp_dim // 40  # a copy's experts share a column
    assert len({router[..., e].tobytes() for e in range(moe.num_experts)}) == copies


def test_upcycled_model_is_not_the_dense_model_without_renormalising(dense):
    """`copy` without renormalising scales each MLP by the chosen weights' sum (< 1)."""
    source, dense_logits = dense
    moe = config_lib.MoEConfig(**EXACT["copy"], renormalize=False)
    got = _logits(*_upcycled(source, moe, "copy"), TOKENS)
    assert not np.allclose(got, dense_logits, atol=1e-3)


def _train(workdir, *args: str) -> subprocess.CompletedProcess:
    """`python -m moe_jax.train` forked from the warm interpreter (`tests.warm`)."""
    return run_command(ROOT, "train", [*TINY, f"--workdir={workdir}", *args], warm=True)


def test_init_from_and_upcycle_from_the_command_line(tmp_path):
    """A dense run (AdamW); a new run from its weights under Muon (step 1's learning
    rate is 0 in the warmup, so its step-1 weights are the source's exactly, with a
    fresh optimizer of its own; the source's checkpoints are read as the source saved
    them and left as they are); an MoE run upcycled from it trains."""
    dense = ["--config.model.first_k_dense=2", "--config.train.steps=2"]
    done = _train(tmp_path / "dense", *dense)
    assert done.returncode == 0, done.stderr[-3000:]
    tuned = _train(
        tmp_path / "tuned", *dense, "--config.train.steps=1", "--config.train.optimizer=muon",
        f"--config.train.init_from={tmp_path / 'dense'}",
    )  # fmt: skip
    assert not (tmp_path / "dense" / "checkpoints-damaged").exists(), tuned.stdout
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert (
        f"initialised from {tmp_path / 'dense'}, at step 0 with a fresh optimizer" in tuned.stdout
    )
    *_, source = saved_run.restore(tmp_path / "dense", config_lib.ParallelConfig())
    *_, target = saved_run.restore(tmp_path / "tuned", config_lib.ParallelConfig())
    assert int(target.step) == 1
    for name, leaf in param_paths(source.params).items():
        np.testing.assert_array_equal(np.asarray(param_paths(target.params)[name]), leaf, name)
    moe = _train(
        tmp_path / "moe", "--config.train.steps=2", "--config.moe.expert_mlp_dim=64",
        f"--config.train.init_from={tmp_path / 'dense'}", "--config.train.upcycle=copy",
    )  # fmt: skip
    assert moe.returncode == 0, moe.stderr[-3000:]
    assert "(upcycled: copy)" in moe.stdout
    rows = [json.loads(line) for line in (tmp_path / "moe" / "metrics.jsonl").open()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))


def _upcycled_params(source, parallel: config_lib.ParallelConfig):
    """This run's upcycled parameters (5 layers, the first dense) in canonical form, on
    the host, under `parallel`."""
    model = dataclasses.replace(DENSE.model, num_layers=5, first_k_dense=1)
    train = dataclasses.replace(DENSE.train, init_from=str(source), upcycle="copy")
    moe = config_lib.MoEConfig(**EXACT["copy"])
    config = dataclasses.replace(DENSE, model=model, moe=moe, train=train, parallel=parallel)
    init_from.check(config)
    config, layout, _, fresh = _fresh(config)
    params = init_from.initial_params(config, layout, fresh.params)
    return params, jax.device_get(pipeline.canonical(params))


def test_upcycling_into_a_pipeline_holds_the_unpipelined_upcycle(tmp_path):
    """The upcycle is made in the canonical [layers, ...] form, then held as the
    pipeline holds it ([repeats, layers / repeats, ...], split over stages): the same
    values as the unpipelined upcycle's, leaf by leaf (the fresh routers are the same:
    one seed, one canonical form)."""
    dense = dataclasses.replace(DENSE.model, num_layers=5, first_k_dense=5)
    _saved_run(dataclasses.replace(DENSE, model=dense), tmp_path / "dense")
    flat = config_lib.ParallelConfig(attention="dp", experts="ep_a2a", intra=2, data=4)
    piped = dataclasses.replace(flat, data=1, stages=4, microbatches=4)
    circular = dataclasses.replace(flat, data=2, stages=2, microbatches=2, repeats=2)
    _, want = _upcycled_params(tmp_path / "dense", flat)
    for parallel in (piped, circular):
        held, got = _upcycled_params(tmp_path / "dense", parallel)
        gate = param_paths(held)["moe/units/blocks/0/ffn/gate"]
        r = parallel.repeats
        assert gate.shape == ((r, 4 // r) if r > 1 else (4,)) + (4, 24, 40)
        for name, leaf in param_paths(want).items():
            np.testing.assert_array_equal(param_paths(got)[name], leaf, name)
