"""A new run's weights from `train.init_from`: another moe_jax run (its newest
checkpoint) or a Hugging Face checkpoint directory. The run starts at step 0 with a
fresh optimizer (a fine-tune, not a resume; a run that has its own checkpoint resumes
it and ignores this).

With `train.upcycle`, a dense source becomes this MoE model (sparse upcycling,
Komatsuzaki et al.): attention, norms and embeddings are copied, each MoE layer's
experts come from the source's MLP of the same layer, and the router is this run's
fresh one.

* `copy`: every expert is the whole dense MLP. The MoE layer then computes
  (sum of the chosen weights) x MLP(x): exactly the dense model when the weights sum to
  one (`moe.renormalize`, softmax scores, `moe.routed_scaling=1`, dropless).
* `split` (fine-grained, as Megatron-Core's granular upcycling): the dense width F is
  cut into g = F / moe.expert_mlp_dim slices, expert e is slice e mod g of copy e div g,
  and router column e repeats the fresh column of its copy, so a copy's g experts score
  the same. Choosing whole copies (`moe.top_k` a multiple of g), renormalised and scaled
  by `moe.routed_scaling=g`, the layer sums every slice once: exactly the dense model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from moe_jax import checkpoint
from moe_jax import config as config_lib
from moe_jax.checkpoint import Checkpointer
from moe_jax.convert.hf_import import load_params, param_paths, read_hf_config
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel import pipeline
from moe_jax.plan.resolve import check_plan
from moe_jax.train_step import abstract_state, with_shardings

# What upcycling keeps from the source: these must match.
SHARED_MODEL = (
    "vocab_size", "num_layers", "embed_dim", "num_heads", "num_kv_heads", "head_dim",
    "tie_embeddings", "qkv_bias", "qk_norm", "attention", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
)  # fmt: skip


def _source(path: Path):
    """(kind 'run' or 'hf', its architecture as a Config, family or None), or one line."""
    if (path / "checkpoints").is_dir() and (path / "config.json").is_file():
        return "run", config_lib.load(json.loads((path / "config.json").read_text())), None
    if (path / "config.json").is_file():
        family, config, _ = read_hf_config(path)
        return "hf", config, family
    raise ValueError(
        f"train.init_from={str(path)!r} is neither a moe_jax run directory (config.json "
        "and checkpoints/) nor a Hugging Face checkpoint directory (config.json)"
    )


def check(config: config_lib.Config) -> None:
    """One line for a source that cannot start this run, before anything compiles."""
    tc = config.train
    if not tc.init_from:
        return
    _, source, _ = _source(Path(tc.init_from))
    where = f"train.init_from={tc.init_from!r}"
    if tc.upcycle == "none":
        ours, theirs = (checkpoint.architecture(dataclasses.asdict(c)) for c in (config, source))
        for key in sorted(ours):
            if ours[key] != theirs.get(key):
                raise ValueError(
                    f"{where} is another model: {key}={theirs.get(key)!r} there, "
                    f"{ours[key]!r} here (train.upcycle turns a dense model into an MoE)"
                )
        return
    m, s, e = config.model, source.model, config.moe
    if s.num_moe_layers:
        raise ValueError(f"{where}: train.upcycle={tc.upcycle!r} needs a dense source")
    if not m.num_moe_layers:
        raise ValueError(f"train.upcycle={tc.upcycle!r} needs MoE layers in this model")
    for key in SHARED_MODEL:
        if getattr(m, key) != getattr(s, key):
            raise ValueError(
                f"{where}: model.{key}={getattr(s, key)!r} there, {getattr(m, key)!r} here; "
                "upcycling keeps everything but the MLPs"
            )
    if e.num_shared_experts:
        raise ValueError("train.upcycle: moe.num_shared_experts must be 0 (no source for them)")
    dense_here = m.first_k_dense or m.moe_every > 1
    if dense_here and m.mlp_dim != s.mlp_dim:
        raise ValueError(f"{where}: model.mlp_dim={s.mlp_dim} there, {m.mlp_dim} here")
    if tc.upcycle == "copy" and e.expert_mlp_dim != s.mlp_dim:
        raise ValueError(
            f"train.upcycle='copy': moe.expert_mlp_dim={e.expert_mlp_dim} must equal the "
            f"source's model.mlp_dim={s.mlp_dim}"
        )
    if tc.upcycle == "split":
        g = s.mlp_dim // e.expert_mlp_dim
        if s.mlp_dim % e.expert_mlp_dim or e.num_experts % g:
            raise ValueError(
                f"train.upcycle='split': moe.expert_mlp_dim={e.expert_mlp_dim} must divide the "
                f"source's model.mlp_dim={s.mlp_dim} into g slices, g dividing "
                f"moe.num_experts={e.num_experts}"
            )


def _unpipelined(config: config_lib.Config) -> config_lib.Config:
    """This run's plan without its pipeline, on the same devices in the same order: its
    stages become data groups (a pipelined batch splits into them)."""
    p = config.parallel
    if p.stages == 1:
        return config
    flat = dataclasses.replace(p, stages=1, microbatches=1, repeats=1, data=p.data * p.stages)
    return dataclasses.replace(config, parallel=flat)


def _source_params(config: config_lib.Config, layout, say):
    """The source's parameters in their canonical form ([layers, ...] stacks, as a
    checkpoint holds them) on this run's devices. The same model is read under this
    run's own plan, a pipelined stack split over 'stage' as its checkpoint restores it;
    a dense source to upcycle (no stack to pipeline) under the plan without the
    pipeline (`_unpipelined`)."""
    kind, source, family = _source(Path(config.train.init_from))
    plan = config if config.train.upcycle == "none" else _unpipelined(config)
    # the state as the source saved it: its optimizer's (and its clipping's) structure
    shaped = {k: getattr(source.train, k) for k in ("optimizer", "grad_clip")}
    train = dataclasses.replace(plan.train, **shaped)
    theirs = check_plan(
        dataclasses.replace(plan, model=source.model, moe=source.moe, train=train),
        jax.device_count(),
    )
    devices = layout.mesh.devices.reshape(-1)
    their_layout = mesh_lib.make_layout(theirs, mesh_lib.make_mesh(theirs, devices))
    _, abstract = abstract_state(theirs, their_layout)
    shardings = mesh_lib.train_state_shardings(abstract, their_layout, theirs.parallel.zero)
    path = Path(config.train.init_from)
    if kind == "hf":
        wanted = pipeline.canonical(with_shardings(abstract.params, shardings.params))
        places = jax.tree.map(lambda x: x.sharding, wanted)
        return load_params(path, family, theirs, wanted, places)
    checkpoints = Checkpointer(path / "checkpoints", theirs.train.keep_checkpoints)
    try:
        found = checkpoints.restore_newest(with_shardings(abstract, shardings), say, own=False)
    finally:
        checkpoints.close()
    if found is None:
        raise ValueError(f"train.init_from={str(path)!r}: no readable checkpoint")
    return pipeline.canonical(found[1].params)


def _layers(config: config_lib.Config, stack: str, block: int) -> list[int]:
    """Model layers of one block of a stack, unit by unit (`ModelConfig.block_of` inverted)."""
    where = (config.model.block_of(i)[:3] for i in range(config.model.num_layers))
    return [i for i, (s, _, b) in enumerate(where) if (s, b) == (stack, block)]


def _upcycled(config: config_lib.Config, source, fresh):
    """This run's parameters from a dense `source` (see the module docstring)."""
    e, src, out = config.moe, param_paths(source), {}
    g = _slices(config, src)
    for path, leaf in param_paths(fresh).items():
        stack, _, rest = path.partition("/units/blocks/")
        if not rest:  # embedding, final norm, head
            out[path] = src[path]
            continue
        block, name = rest.split("/", 1)
        numbers = _layers(config, stack, int(block))
        layers = jnp.array(numbers)
        moe = config.model.block_of(numbers[0])[3]
        if name == "ffn/router":  # fresh; a copy's g experts share its column
            out[path] = jnp.repeat(leaf[..., : e.num_experts // g], g, axis=-1)
            continue
        dense = jnp.take(src[f"dense/units/blocks/0/{name}"], layers, axis=0)
        out[path] = (
            _experts(dense, name, g, e.num_experts) if moe and name.startswith("ffn/") else dense
        )
    return jax.tree.unflatten(jax.tree.structure(fresh), [out[p] for p in param_paths(fresh)])


def _slices(config: config_lib.Config, src: dict) -> int:
    if config.train.upcycle == "copy":
        return 1
    width = src["dense/units/blocks/0/ffn/gate"].shape[-1]
    return width // config.moe.expert_mlp_dim


def _experts(dense: jax.Array, name: str, g: int, n: int) -> jax.Array:
    """[units, d, F] gate/up or [units, F, d] down -> [units, n, d, F/g] or
    [units, n, F/g, d]: expert e is slice e mod g."""
    units = dense.shape[0]
    if name == "ffn/down":
        slices = dense.reshape(units, g, dense.shape[1] // g, dense.shape[2])
    else:
        slices = jnp.moveaxis(dense.reshape(units, dense.shape[1], g, -1), 2, 1)
    return jnp.tile(slices, (1, n // g, 1, 1))


def initial_params(config: config_lib.Config, layout, fresh, say=print):
    """The run's starting parameters from `train.init_from`, placed like `fresh` (this
    run's freshly initialised parameters, whose router an upcycle keeps): made in the
    canonical form, then held as this run's pipeline holds them (`pipeline.staged`)."""
    source = _source_params(config, layout, say)
    if config.train.upcycle != "none":
        canonical = pipeline.canonical(fresh)
        shardings = jax.tree.map(lambda x: x.sharding, canonical)
        upcycle = jax.jit(lambda s, f: _upcycled(config, s, f), out_shardings=shardings)
        source = upcycle(source, canonical)
    held = pipeline.staged(source, fresh)
    return jax.device_put(held, jax.tree.map(lambda x: x.sharding, fresh))
