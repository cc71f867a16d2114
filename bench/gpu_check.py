"""One script for a GPU session: checks the GPU paths against the CPU-tested ones and
times them, in one run that fits a time budget and keeps what it measured.

    python bench/gpu_check.py --out DIR              # on the GPU machine
    python bench/gpu_check.py --small --out DIR      # a quick dry run anywhere

It starts from a plain checkout (the repository root is put on the path; no install,
no ml_collections), offline. Sections, in order of value, each skipped when the time
left (`--budget`, from the start) does not cover what it needs:

1. versions: GPU, memory, driver, jax, jaxlib, CUDA plugin, cuDNN, flax, optax,
   Python (`bench/gpu_versions.py`), then every section's imports;
2. kernel_correctness: each grouped matmul's three products and the fused Pallas ops
   against float64 references (`bench/gpu_kernels.py`);
3. attention_correctness: cuDNN flash attention and the blockwise core against
   float32 `xla`, and remat='offload' against 'selective' (`bench/gpu_attention.py`);
4. block_correctness: the MoE block per impl against `dense` (`bench/gpu_block.py`);
5. gemm_timing: TFLOP/s of the three GEMMs per impl at the Mixtral-8x7B, DeepSeek-MoE
   and 352B shapes against a dense matmul, each program's memory checked first;
6. block_timing: forward+backward of the block per impl against a dense SwiGLU;
7. permutation_timing: dispatch/combine bandwidth against a copy, fused maps' cost;
8. ragged_exchange: the ragged all-to-all layout against the padded one
   (`bench/gpu_ragged_exchange.py`; on CPU only lowered);
9. attention_timing: the attention cores' time against `xla`.

`--out DIR` writes DIR/gpu_check.json after every result and section and the whole
log to DIR/gpu_check.log; SIGINT, SIGTERM and the end of the budget stop the run with
the report written. The last stdout line is the report as one JSON object. Exit
status: 0 when every check that ran passed, 1 when one failed, 128 + the signal's
number when a signal stopped it.
"""

from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path

import gpu_session  # the standard library only: jax is imported in `versions`

SECTIONS = (
    # name, module:function, seconds needed to start with --small on CPU, on a GPU (a
    # correctness section's whole time, a timing section's first item; the H200 run of
    # 2026-12-04 took 48, 37 and 192 s for the three correctness sections)
    ("versions", "gpu_versions:section", 0, 0),
    ("kernel_correctness", "gpu_kernels:correctness", 15, 60),
    ("attention_correctness", "gpu_attention:correctness", 2, 45),
    ("block_correctness", "gpu_block:correctness", 10, 200),
    ("gemm_timing", "gpu_kernels:time_gemms", 3, 30),
    ("block_timing", "gpu_block:timing", 5, 20),
    ("permutation_timing", "gpu_kernels:time_permutation", 5, 20),
    ("ragged_exchange", "gpu_ragged_exchange:section", 5, 30),
    ("attention_timing", "gpu_attention:timing", 2, 15),
)


def _versions(ctx: gpu_session.Section) -> None:
    """Reports the versions, then imports every section's module: an import error
    fails this section, and with it the run, in the report, versions included."""
    importlib.import_module("gpu_versions").section(ctx)
    for _, target, *_ in SECTIONS:
        importlib.import_module(target.split(":")[0])


def _function(target: str):
    module, name = target.split(":")
    return lambda ctx: getattr(importlib.import_module(module), name)(ctx)


def steps(names: list[str] | None = None) -> list[gpu_session.Step]:
    """The sections to run, in order (`names`: those, and always `versions` first)."""
    chosen = []
    for name, target, small, full in SECTIONS:
        if name == "versions" or names is None or name in names:
            run = _versions if name == "versions" else _function(target)
            chosen.append(gpu_session.Step(name, run, small, full))
    return chosen


def main() -> None:
    start = time.monotonic()  # the budget counts from here, jax's import included
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a dry run")
    parser.add_argument(
        "--budget", type=float, default=420.0, help="seconds for the whole run (default 420)"
    )
    parser.add_argument("--out", type=Path, help="directory for gpu_check.json and .log")
    parser.add_argument(
        "--sections",
        help="comma-separated sections to run (default: all), e.g. a second try's rest: "
        + ",".join(name for name, *_ in SECTIONS[1:]),
    )
    args = parser.parse_args()
    names = args.sections.split(",") if args.sections else None
    valid = [name for name, *_ in SECTIONS]
    unknown = sorted(set(names or ()) - set(valid))
    if unknown:
        parser.exit(2, f"error: --sections: unknown {unknown[0]!r}; valid: {','.join(valid)}\n")
    if not args.budget > 0:
        parser.exit(2, f"error: --budget must be positive seconds, not {args.budget:g}\n")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.exit(2, f"error: --out {args.out} exists and is not a directory\n")
    if args.out is not None:
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            parser.exit(2, f"error: --out {args.out}: {error.strerror or error}\n")
    status = gpu_session.run(steps(names), args.small, args.budget, args.out, start)
    raise SystemExit(status)


if __name__ == "__main__":
    main()
