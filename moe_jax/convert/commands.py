"""`import` and `export`, as functions of paths and a plan (the command line is
`moe_jax.convert.__main__`). Every check that can refuse runs before anything is
written; what is written is complete or absent."""

from __future__ import annotations

import dataclasses
import json
import shutil
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp

from moe_jax import config as config_lib
from moe_jax import paths, saved_run
from moe_jax.checkpoint import Checkpointer
from moe_jax.config_sources import tokenizer_directory
from moe_jax.convert import families, hf_export, hf_import
from moe_jax.data.token_files import TOKENIZER_FILE, read_meta, tokenizer_spec
from moe_jax.optimizer import make_optimizer
from moe_jax.train_state import TrainState

CONFIG_FILE = '''"""{architecture} imported from {source} by `python -m moe_jax.convert import`.

Train from it with `python -m moe_jax.train --config={config} --workdir={workdir}`
(resumes its step 0: a fine-tune), or start another run from its weights with
`--config.train.init_from={workdir}`.
"""

from moe_jax.config import Config, ModelConfig, MoEConfig, to_config_dict


def get_config():
    return to_config_dict(
        Config(
            model=ModelConfig(**{model!r}),
            moe=MoEConfig(**{moe!r}),
        )
    )
'''


MTP_CHOICES = ("keep", "drop")


def _refuse_used(directory: Path, flag: str) -> None:
    paths.check_output_dir(directory, flag)
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{flag}={directory} is not empty; nothing is overwritten: use a new one")


def _staging(target: Path) -> Path:
    """A new directory beside `target`, made with the umask's permissions (mkdtemp's are
    0700: colleagues on a shared file system could not read what is moved in)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.tmp"
    staging.mkdir()
    return staging


def _run_tokenizer(config: config_lib.Config) -> Path | None:
    """The tokenizer.json of the run's prepared data, if it had one and it is there."""
    if config.data.source != "tokens":
        return None
    try:
        data = tokenizer_directory(config.data)  # data.path, or a mixture's first source
        spec = tokenizer_spec(data, read_meta(data))
    except ValueError:  # the data is gone: the weights export without it
        return None
    return Path(spec) if spec != "byte" and Path(spec).is_file() else None


def fresh_state(config: config_lib.Config, params, biases_like) -> TrainState:
    """Step 0 of a run from `params`: a new optimizer state and router biases of zero
    (shaped as `biases_like`)."""
    opt_state = make_optimizer(config.train).init(params)
    rng = jax.random.key_data(jax.random.key(config.train.seed))
    zeros = jax.tree.map(lambda b: jnp.zeros(b.shape, b.dtype), biases_like)
    return TrainState(jnp.zeros((), jnp.int32), params, zeros, opt_state, rng)


def import_hf(
    hf_dir: Path, workdir: Path, base: config_lib.Config, mtp: str = "keep"
) -> config_lib.Config:
    """`hf_dir` into `workdir` as a run at step 0 under `base`'s plan and training
    settings (its model and moe sections come from the checkpoint); returns the config.
    `mtp='drop'` leaves a DeepSeek checkpoint's MTP layers out (one line says so)."""
    if mtp not in MTP_CHOICES:
        raise ValueError(f"--mtp={mtp!r} is invalid; valid: {list(MTP_CHOICES)}")
    _refuse_used(workdir, "--workdir")
    family, arch, _ = hf_import.read_hf_config(hf_dir)
    if mtp == "drop" and arch.model.mtp_depth:
        depth, first = arch.model.mtp_depth, arch.model.num_layers
        arch = dataclasses.replace(arch, model=dataclasses.replace(arch.model, mtp_depth=0))
        print(
            f"--mtp=drop: left out the checkpoint's {depth} MTP layer(s) "
            f"(model.layers.{first}..{first + depth - 1}); model.mtp_depth=0"
        )
    keep = {k: getattr(base.model, k) for k in ("dtype", "remat", "attention_impl")}
    model = dataclasses.replace(arch.model, **keep)
    moe = dataclasses.replace(arch.moe, impl=base.moe.impl, tile_size=base.moe.tile_size)
    config = config_lib.load(dataclasses.asdict(dataclasses.replace(base, model=model, moe=moe)))
    if config.parallel.stages > 1:
        raise ValueError(
            "parallel.stages > 1: import with an unpipelined plan; the checkpoint it writes "
            "is canonical and any run (pipelined or not) restores it"
        )
    config, _, _, like = saved_run.placed(config, config.parallel)
    shardings = jax.tree.map(lambda x: x.sharding, like)
    params, biases = hf_import.load_trees(
        hf_dir,
        family,
        config,
        [(like.params, shardings.params), (like.biases, shardings.biases)],
    )
    start = jax.jit(lambda p: fresh_state(config, p, like.biases), out_shardings=shardings)
    state = dataclasses.replace(start(params), biases=biases)  # DeepSeek-V3's correction bias
    settings = dataclasses.asdict(config)
    # Written next to the workdir, then moved in whole: a failure leaves nothing behind.
    staging = _staging(workdir)
    try:
        checkpoints = Checkpointer(staging / "checkpoints", config.train.keep_checkpoints)
        checkpoints.save(0, state, {}, settings)
        checkpoints.close()
        stored = paths.stored(settings, workdir)
        (staging / "config.json").write_text(json.dumps(stored, indent=2) + "\n")
        config_py = staging / "config.py"
        config_py.write_text(
            CONFIG_FILE.format(
                architecture=family.architecture,
                source=hf_dir,
                config=workdir / "config.py",
                workdir=workdir,
                model=dataclasses.asdict(arch.model),
                moe=dataclasses.asdict(arch.moe),
            )
        )
        if workdir.exists():
            workdir.rmdir()  # empty, checked above
        staging.rename(workdir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return config


def export_hf(
    workdir: Path,
    hf_dir: Path,
    parallel: config_lib.ParallelConfig,
    architecture: str | None,
    dtype: str,
    shard_gb: float,
) -> tuple[families.Family, int, list[str]]:
    """The newest checkpoint of the run in `workdir` as a Hugging Face checkpoint in
    `hf_dir`, with the tokenizer.json of the run's data when it had one; returns
    (family, step, files written: the shards, then tokenizer.json if written)."""
    if jax.process_count() > 1:
        raise ValueError("export runs in one process (it writes every tensor itself)")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype={dtype!r} is invalid; valid: 'float32', 'bfloat16'")
    _refuse_used(hf_dir, "--hf")
    family = families.family_for(saved_run.saved_config(workdir), architecture)
    config, _, _, step, state = saved_run.restore(workdir, parallel)
    if family.architecture != families.DEEPSEEK[0]:  # V3 writes its correction bias
        hf_export.check_biases(state.biases)
    tokenizer = _run_tokenizer(config)
    staging = _staging(hf_dir)
    try:
        shards = hf_export.export(
            family, config, state.params, state.biases, staging, dtype, shard_gb
        )
        if tokenizer is not None:  # the Hugging Face layout: tokenizer.json beside the weights
            shutil.copyfile(tokenizer, staging / TOKENIZER_FILE)
            shards = [*shards, TOKENIZER_FILE]
        if hf_dir.exists():
            hf_dir.rmdir()
        staging.rename(hf_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return family, step, shards
