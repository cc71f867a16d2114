"""Hugging Face checkpoints in and out, against transformers itself.

Each family's tiny random model is built by transformers (`moe_jax/convert/transformers_side.py`, in
the Python 3.11 environment `make test` builds, .venv-hf) with dimensions that are
never square and norms, biases and routers re-randomised, so a swapped or transposed
tensor cannot pass. moe_jax imports it (8 forced CPU devices) and must give the same
logits within 1e-4 in float32 and route every token of every MoE layer to the same
experts; the export must load in `from_pretrained` and give them again; import ->
export -> import is bit-identical; the fused expert layout imports to the same bits.
DeepSeek-V3 and V2 (multi-head latent attention, rotary rows re-ordered from their
interleaved layout) also write back every tensor they read, bit for bit, their MTP
layers (which transformers ignores) and V3's router correction bias included.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from functools import cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from moe_jax import config as config_lib
from moe_jax import saved_run
from moe_jax.convert import commands
from moe_jax.convert.hf_import import param_paths
from moe_jax.parallel import mesh as mesh_lib
from tests import hf_side
from tests.commands import run_command

MOE, DENSE = hf_side.MOE, hf_side.DENSE
DATA_PARALLEL = config_lib.ParallelConfig()  # all 8 test devices over data
SP_EP = config_lib.ParallelConfig(attention="sp", experts="ep_a2a", data=2, intra=4)
TP_ETP = config_lib.ParallelConfig(attention="tp", experts="etp", data=2, intra=4)
PLANS = {"sp+ep_a2a": SP_EP, "tp+etp": TP_ETP}

pytestmark = hf_side.NEEDS_HF
_hf = hf_side.run


@pytest.fixture(scope="module")
def built(hf_built):
    return hf_built


def _import(hf: Path, workdir: Path, parallel=DATA_PARALLEL, mtp="keep") -> config_lib.Config:
    return commands.import_hf(
        hf, workdir, dataclasses.replace(config_lib.Config(), parallel=parallel), mtp
    )


@pytest.fixture(scope="module")
def imported(built, tmp_path_factory):
    """Each family imported under DATA_PARALLEL, once for the tests that read the run
    (nothing writes to it)."""
    root = tmp_path_factory.mktemp("imported")

    @cache
    def run(architecture: str) -> Path:
        _import(built(architecture) / "hf", root / architecture)
        return root / architecture

    return run


@pytest.fixture(scope="module")
def exported(built, imported, tmp_path_factory):
    """Each MoE family's import exported in several shards ((directory, what export_hf
    returned)), and transformers' logits and choices of each export in
    directory/logits.npz, from one run of the transformers side."""
    root = tmp_path_factory.mktemp("exported")
    results = {
        arch: commands.export_hf(
            imported(arch), root / arch, DATA_PARALLEL, None, "float32", shard_gb=2e-5
        )
        for arch in MOE
    }
    _hf("logits", *(arg for arch in MOE for arg in (root / arch, built(arch) / "reference.npz")))
    return lambda architecture: (root / architecture, results[architecture])


def _outputs(workdir: Path, tokens: np.ndarray, parallel=DATA_PARALLEL):
    """Logits and per-layer expert loads of the run in `workdir` on `tokens`, under
    `parallel`'s plan."""
    config, layout, graphdef, _, state = saved_run.restore(workdir, parallel)
    model = nnx.merge(graphdef, state.params, state.biases)
    tokens = jax.device_put(tokens.astype(np.int32), mesh_lib.batch_sharding(layout))
    logits, stats = jax.jit(lambda t: model(t))(tokens)
    load = None if stats is None else np.asarray(stats.load)
    return config, np.asarray(logits), load


def _assert_matches(reference: dict, config, logits: np.ndarray, load) -> None:
    np.testing.assert_allclose(logits, reference["logits"], rtol=0, atol=1e-4)
    if "chosen" in reference:
        chosen = reference["chosen"]  # [moe layers, tokens, k], transformers' own top-k
        counts = [np.bincount(c.reshape(-1), minlength=config.moe.num_experts) for c in chosen]
        np.testing.assert_array_equal(load, np.stack(counts))


def _expert_choices(workdir: Path, tokens: np.ndarray) -> np.ndarray:
    """[moe layers, tokens, k] experts moe_jax's router picks, each token's sorted: the
    imported model run block by block through its own modules, the router applied to
    each MoE block's input."""
    from moe_jax.moe.block import MoE
    from moe_jax.moe.routing import route
    from moe_jax.parallel.layout import SINGLE_DEVICE
    from moe_jax.train_step import abstract_state

    config, _, _, _, state = saved_run.restore(workdir, DATA_PARALLEL)
    graphdef, _ = abstract_state(config, SINGLE_DEVICE)
    model = nnx.merge(graphdef, state.params, state.biases)

    def run(tokens):
        x = model.embed(tokens, jnp.float32)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        chosen = []
        for stack in (model.dense, model.moe):
            if stack is None:
                continue
            unit_def, params, rest = nnx.split(stack.units, nnx.Param, ...)
            for u in range(jax.tree.leaves(params)[0].shape[0]):
                unit = nnx.merge(unit_def, *jax.tree.map(lambda a, u=u: a[u], (params, rest)))
                for block in unit.blocks:
                    x = x + block.attn(block.attn_norm(x), positions)
                    h = block.ffn_norm(x)
                    if isinstance(block.ffn, MoE):
                        flat = h.reshape(-1, h.shape[-1])
                        ffn = block.ffn
                        chosen.append(
                            route(flat, ffn.router[...], ffn.bias[...], ffn.cfg).expert_index
                        )
                        x = x + ffn(h)[0]
                    else:
                        x = x + block.ffn(h)
        return jnp.stack(chosen)

    return np.sort(np.asarray(jax.jit(run)(tokens.astype(np.int32))), axis=-1)


@cache
def _params(workdir: Path) -> dict[str, np.ndarray]:
    """The canonical parameters and router biases of the run in `workdir` (read once per
    run: the tests only read them)."""
    *_, state = saved_run.restore(workdir, DATA_PARALLEL)
    biases = {f"biases/{k}": v for k, v in param_paths(state.biases).items()}
    return {k: np.asarray(v) for k, v in {**param_paths(state.params), **biases}.items()}


def _assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


@pytest.mark.parametrize("architecture", MOE + DENSE)
def test_imported_model_gives_transformers_logits_and_expert_choices(
    built, imported, tmp_path, architecture: str
):
    source = built(architecture)
    reference = dict(np.load(source / "reference.npz"))
    run = imported(architecture)
    _assert_matches(reference, *_outputs(run, reference["tokens"]))
    if architecture in MOE:  # the same experts for every token of every MoE layer
        chosen = _expert_choices(run, reference["tokens"])
        np.testing.assert_array_equal(chosen, np.sort(reference["chosen"], axis=-1))
    if architecture in MOE:  # the fused expert layout imports to the same bits
        _import(source / "hf_fused", tmp_path / "fused")
        _assert_identical(_params(run), _params(tmp_path / "fused"))


@pytest.mark.parametrize("architecture", MOE)
def test_export_loads_in_transformers_and_round_trips_bit_identically(
    built, imported, exported, tmp_path, architecture: str
):
    """import -> export (several shards) -> transformers' from_pretrained gives the
    same logits and choices; importing the export gives the same bits."""
    source = built(architecture)
    out, (family, step, shards) = exported(architecture)
    assert (family.architecture, step) == (architecture, 0) and len(shards) > 1
    reference = np.load(source / "reference.npz")
    logits = np.load(out / "logits.npz")
    np.testing.assert_allclose(logits["logits"], reference["logits"], rtol=0, atol=1e-4)
    np.testing.assert_array_equal(logits["chosen"], reference["chosen"])
    _import(out, tmp_path / "again")
    _assert_identical(_params(imported(architecture)), _params(tmp_path / "again"))
    if architecture in hf_side.DEEPSEEK:  # every tensor read is written back, MTP's too
        written = _tensors(out)
        for name, value in _tensors(source / "hf").items():
            assert np.array_equal(written[name], value), name


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    return {k: v for f in directory.glob("*.safetensors") for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize(
    "architecture,plan",
    [(a, "sp+ep_a2a") for a in MOE] + [(a, "tp+etp") for a in hf_side.DEEPSEEK],
)
def test_parity_holds_under_sp_and_ep_a2a(built, tmp_path, capsys, architecture, plan):
    """Imported straight into the sp + ep_a2a plan (2 data groups of 4) and run there;
    the DeepSeek families (heads split after MLA's up-projections) also under tp + etp;
    DeepSeek-V3 under sp with `--mtp=drop`, which leaves its MTP layer out in one line."""
    source = built(architecture)
    reference = dict(np.load(source / "reference.npz"))
    drop = architecture == "DeepseekV3ForCausalLM" and plan == "sp+ep_a2a"
    parallel = PLANS[plan]
    config = _import(source / "hf", tmp_path / "run", parallel, "drop" if drop else "keep")
    if drop:
        assert config.model.mtp_depth == 0
        assert capsys.readouterr().out.splitlines() == [
            "--mtp=drop: left out the checkpoint's 1 MTP layer(s) (model.layers.3..3); "
            "model.mtp_depth=0"
        ]
    _assert_matches(reference, *_outputs(tmp_path / "run", reference["tokens"], parallel))


@pytest.mark.parametrize(
    "damage,message",
    [
        ("architecture", "architecture 'GptOssForCausalLM' is not supported"),
        ("no mtp layer", "model.layers.3 is not stored (transformers saves none): import with"),
        ("fp8 without scales", "has no block scales model.layers.0.self_attn.kv_b_proj.weight_"),
        ("missing shard", "shard model-00002-of-00002.safetensors named by"),
        ("wrong shape", "tensor model.norm.weight has shape [39], expected [40]"),
        ("unknown tensor", "tensor model.layers.0.mlp.extra.weight is not used"),
        ("missing tensor", "tensor model.layers.2.self_attn.q_proj.weight is missing"),
        ("no hidden_size", "config.json has no 'hidden_size' setting"),
        ("truncated shard", "model.safetensors is not a readable safetensors file"),
    ],
)
def test_bad_checkpoints_are_refused_in_one_line_writing_nothing(
    built, tmp_path, damage: str, message: str
):
    if damage == "fp8 without scales":  # DeepSeek-V3's as it ships, its scales shard lost
        from tests.fp8_checkpoint import write_quantised

        source = built("DeepseekV3ForCausalLM") / "hf"
        config = json.loads((source / "config.json").read_text())
        pick = lambda name: "f32" if name.endswith("kv_b_proj.weight") else None
        hf = tmp_path / "hf"
        write_quantised(load_file(str(source / "model.safetensors")), config, hf, pick)
        (hf / "model-00002-of-00002.safetensors").unlink()
        index = json.loads((hf / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if "_scale" not in k}
        (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        arch = "DeepseekV3ForCausalLM" if damage == "no mtp layer" else "MixtralForCausalLM"
        hf = Path(shutil.copytree(built(arch) / "hf_fused", tmp_path / "hf"))
        tensors = load_file(str(hf / "model.safetensors"))
    if damage == "architecture":
        config = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(
            json.dumps({**config, "architectures": ["GptOssForCausalLM"]})
        )
    elif damage == "fp8 without scales":
        pass
    elif damage == "no mtp layer":  # as transformers saves a V3 (config still says 1)
        tensors = {k: v for k, v in tensors.items() if not k.startswith("model.layers.3.")}
        save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    elif damage == "no hidden_size":
        config = json.loads((hf / "config.json").read_text())
        del config["hidden_size"]
        (hf / "config.json").write_text(json.dumps(config))
    elif damage == "truncated shard":
        shard = hf / "model.safetensors"
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "missing shard":
        index = {"weight_map": {k: "model-00001-of-00002.safetensors" for k in tensors}}
        index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
        (hf / "model.safetensors.index.json").write_text(json.dumps(index))
        (hf / "model.safetensors").rename(hf / "model-00001-of-00002.safetensors")
    else:
        if damage == "wrong shape":
            tensors["model.norm.weight"] = tensors["model.norm.weight"][:39]
        elif damage == "unknown tensor":
            tensors["model.layers.0.mlp.extra.weight"] = np.zeros((3, 5), np.float32)
        else:
            del tensors["model.layers.2.self_attn.q_proj.weight"]
        save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    run = run_command(
        tmp_path, "convert", ["import", f"--hf={hf}", f"--workdir={tmp_path / 'run'}"], warm=True
    )
    assert run.returncode == 1, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "run").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no staging directory left


def test_import_and_export_from_the_command_line(built, tmp_path):
    """The commands (forked from the warm interpreter; test_bad_inputs runs each command
    line as a real subprocess): import into a fresh workdir, train two steps from it (the
    fine-tune resumes its step 0), export the trained weights."""
    source = built("Qwen3MoeForCausalLM")
    run = run_command(
        tmp_path, "convert", ["import", f"--hf={source / 'hf'}", "--workdir=run"], warm=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "into run: config.py, config.json, checkpoints/0" in run.stdout
    train = run_command(
        tmp_path,
        "train",
        [
            "--config=run/config.py",
            "--workdir=run",
            "--config.train.steps=2",
            "--config.train.batch_size=2",
            "--config.train.seq_len=16",
            "--config.train.eval_batches=1",
            "--config.train.log_every=1",
        ],
        warm=True,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    run = run_command(tmp_path, "convert", ["export", "--workdir=run", "--hf=out"], warm=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "exported step 2 of run as Qwen3MoeForCausalLM into out" in run.stdout
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["head_dim"] == 12


def test_a_transformers_llama_upcycled_to_moe_keeps_its_logits(built):
    """`train.init_from` a Hugging Face directory with `train.upcycle='copy'`: the MoE
    model (every layer's 4 experts copies of Llama's MLP, renormalised top 2) gives
    transformers' Llama logits."""
    from moe_jax import init_from
    from moe_jax.convert.hf_import import read_hf_config
    from moe_jax.train_step import init_program

    source = built("LlamaForCausalLM")
    _, dense, _ = read_hf_config(source / "hf")
    model = dataclasses.replace(dense.model, first_k_dense=0)
    moe = config_lib.MoEConfig(num_experts=4, top_k=2, expert_mlp_dim=dense.model.mlp_dim)
    train = config_lib.TrainConfig(
        batch_size=8, seq_len=16, init_from=str(source / "hf"), upcycle="copy"
    )
    config = config_lib.Config(model=model, moe=moe, train=train)
    init_from.check(config)
    config, layout, graphdef, like = saved_run.placed(config, config.parallel)
    fresh = init_program(config, layout, jax.tree.map(lambda x: x.sharding, like))()
    params = init_from.initial_params(config, layout, fresh.params)
    reference = np.load(source / "reference.npz")
    model = nnx.merge(graphdef, params, fresh.biases)
    logits, stats = jax.jit(lambda t: model(t))(reference["tokens"].astype(np.int32))
    assert stats.load.shape == (3, 4)  # every layer is an MoE layer now
    np.testing.assert_allclose(np.asarray(logits), reference["logits"], rtol=0, atol=1e-4)


def _first_step(config, parallel, source: Path, grad_accum: int = 1):
    """(metrics, canonical parameters after it, the initial state) of the first step of a
    run under `parallel` started by `train.init_from=source`."""
    from moe_jax import init_from
    from moe_jax.optimizer import rates
    from moe_jax.parallel import pipeline
    from moe_jax.train_step import init_program
    from tests.layouts import batch

    train = dataclasses.replace(config.train, init_from=str(source), grad_accum=grad_accum)
    config = dataclasses.replace(config, train=train, parallel=parallel)
    init_from.check(config)
    config, layout, graphdef, like = saved_run.placed(config, config.parallel)
    fresh = init_program(config, layout, jax.tree.map(lambda x: x.sharding, like))()
    params = init_from.initial_params(config, layout, fresh.params)
    state = dataclasses.replace(fresh, params=params)
    start = dataclasses.replace(config.train, init_from="")  # the step reads no source
    sharding = mesh_lib.batch_sharding(layout)
    inputs = {k: jax.device_put(v, sharding) for k, v in batch(config).items()}
    lr = rates(config.train, 0, 1)[0]
    after, metrics = _step(graphdef, dataclasses.replace(config, train=start))(state, inputs, lr)
    return jax.device_get(metrics), jax.device_get(pipeline.canonical(after.params)), state


@cache
def _step(graphdef, config):
    """The jitted train step, one per plan: runs that differ only in where their weights
    come from share it."""
    from moe_jax.train_step import train_step

    return jax.jit(lambda s, b, lr: train_step(graphdef, config, s, b, lr))


def test_init_from_into_a_pipeline_trains_as_the_unpipelined_run(built, tmp_path):
    """`train.init_from` a Hugging Face directory, and a moe_jax run, into a 2-stage
    pipelined run (Qwen2-MoE: a dense first layer, two MoE layers): its first step (the
    two micro-batches through the stages) equals the unpipelined run accumulating the
    same two micro-batches, within 1e-5."""
    from moe_jax.checkpoint import Checkpointer
    from moe_jax.convert.hf_import import read_hf_config
    from tests.layouts import assert_trees_close

    hf = built("Qwen2MoeForCausalLM") / "hf"
    _, arch, _ = read_hf_config(hf)
    config = dataclasses.replace(arch, train=config_lib.TrainConfig(batch_size=8, seq_len=16))
    flat = config_lib.ParallelConfig(attention="sp", experts="ep_a2a", intra=4, data=2)
    piped = dataclasses.replace(flat, data=1, stages=2, microbatches=2)
    want, want_params, start = _first_step(config, flat, hf, grad_accum=2)
    run = tmp_path / "run"  # the same weights as a moe_jax run
    checkpoints = Checkpointer(run / "checkpoints", 1)
    checkpoints.save(0, start, {}, dataclasses.asdict(config))
    checkpoints.close()
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
    for source in (hf, run):
        got, got_params, _ = _first_step(config, piped, source)
        assert got["skipped"] == 0 and np.isfinite(got["loss"])
        for key in ("loss", "lm_loss", "aux_loss", "grad_norm", "load"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
        assert_trees_close(got_params, want_params, rtol=1e-5)


def test_fp8_block_scaled_checkpoint_imports_to_the_dequantised_values(built, tmp_path):
    """Mixtral's tiny model quantised here to float8_e4m3fn with 128x128 block scales, as
    DeepSeek-V3 ships its weights (float32 scales; the experts' down projections with
    "ue8m0" power-of-two scales; lm_head [301, 40] spans three row blocks, the last
    cropped to 45 rows; weights and scales in different shards): the import holds
    exactly the float32 values of each block times its scale, i.e. the same bits as
    importing those values stored as float32."""
    from tests.fp8_checkpoint import write_quantised

    source = built("MixtralForCausalLM") / "hf"
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())

    def pick(name: str) -> str | None:  # every linear weight but the router's
        if name.endswith("norm.weight") or "embed" in name or name.endswith("gate.weight"):
            return None
        return "ue8m0" if name.endswith(".w2.weight") else "f32"

    values = write_quantised(tensors, config, tmp_path / "fp8", pick)
    assert not np.array_equal(values["lm_head.weight"], tensors["lm_head.weight"])
    plain = tmp_path / "float32"
    plain.mkdir()
    save_file(values, str(plain / "model.safetensors"), metadata={"format": "pt"})
    (plain / "config.json").write_text(json.dumps(config))
    _import(tmp_path / "fp8", tmp_path / "from_fp8")
    _import(plain, tmp_path / "from_float32")
    _assert_identical(_params(tmp_path / "from_fp8"), _params(tmp_path / "from_float32"))
