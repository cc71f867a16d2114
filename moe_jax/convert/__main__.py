"""`python -m moe_jax.convert import --hf DIR --workdir OUT` and
`python -m moe_jax.convert export --workdir RUN --hf OUT [--arch A] [--dtype D]`.

`import` reads a Hugging Face checkpoint (config.json and *.safetensors) of a supported
family (`--mtp=drop` leaves a DeepSeek-V3 checkpoint's MTP layers out) and writes a
moe_jax run directory at step 0: config.py, config.json and an
orbax checkpoint. `export` writes the newest checkpoint of a run as config.json and
sharded safetensors that transformers' `from_pretrained` loads. Both take the plan
they place the weights under as `--config.parallel.*` (default: this machine's
devices, data parallel). Both check their directories before anything is read, and
write with the user's umask; `export` copies the run's tokenizer.json beside the
weights. Exit status: 0 when done, 1 on bad input, 130 on SIGINT or SIGTERM (nothing
left behind).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from absl import app, flags

from moe_jax import cli, paths, signals
from moe_jax import config as config_lib

_CONFIG = cli.define_config_flag()
_HF = flags.DEFINE_string("hf", None, "Hugging Face checkpoint directory (read or written).")
_WORKDIR = flags.DEFINE_string("workdir", None, "moe_jax run directory (written or read).")
_ARCH = flags.DEFINE_string(
    "arch", None, "export: the family to write (default: the one that holds the model)."
)
_DTYPE = flags.DEFINE_string("dtype", "float32", "export: dtype of the written tensors.")
_MTP = flags.DEFINE_enum(
    "mtp",
    "keep",
    ["keep", "drop"],
    "import: a DeepSeek checkpoint's MTP layers into model.mtp_depth modules, or left out.",
)
_SHARD_GB = flags.DEFINE_float("shard_gb", 5.0, "export: largest shard file, in GiB.")
flags.register_validator(
    "shard_gb",
    lambda gb: math.isfinite(gb) and gb * 2**30 >= 1,
    "must be a finite size in GiB, at least one byte (e.g. --shard_gb=5)",
)
COMMANDS = ("import", "export")


@signals.interruptible("the conversion")
def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[1] not in COMMANDS:
        raise SystemExit(f"error: give one command, {' or '.join(COMMANDS)}; got {argv[1:]}")
    for flag, value in (("--hf", _HF.value), ("--workdir", _WORKDIR.value)):
        if not value:
            raise SystemExit(f"error: {argv[1]} needs {flag}=DIR")
    try:
        config = config_lib.load(_CONFIG.value)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    from moe_jax.convert import commands  # after validation: slow imports

    hf, workdir = Path(_HF.value), Path(_WORKDIR.value)
    try:
        if argv[1] == "import":
            paths.check_input(hf, "--hf", "dir")
        else:
            paths.check_input(workdir, "--workdir", "dir")
        if argv[1] == "import":
            imported = commands.import_hf(hf, workdir, config, _MTP.value)
            m = imported.model
            experts = imported.moe.num_experts if m.num_moe_layers else 0
            print(
                f"imported {hf} ({m.num_layers} layers, {experts} experts) into {workdir}: "
                "config.py, config.json, checkpoints/0"
            )
        else:
            family, step, files = commands.export_hf(
                workdir, hf, config.parallel, _ARCH.value, _DTYPE.value, _SHARD_GB.value
            )
            shards = [f for f in files if f.endswith(".safetensors")]
            extra = " and tokenizer.json" if len(files) > len(shards) else ""
            print(
                f"exported step {step} of {workdir} as {family.architecture} into {hf}: "
                f"config.json, {len(shards)} safetensors shard(s){extra}"
            )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse)
