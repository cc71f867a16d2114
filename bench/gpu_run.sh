#!/bin/sh
# The GPU machine's one command: `sh bench/gpu_run.sh OUT [gpu_check.py flags]` from a
# plain checkout, offline (docs/kernels-and-benchmarks.md#gpu-checks).
# 1. Installs the wheels of `make gpu-wheels` carried in .whl/, if any, into a
#    directory on PYTHONPATH (WHEELS_SITE, default /tmp/moe_jax_site; gpu_check.py
#    itself needs none of them, so a failure here is reported and the run goes on).
#    .whl/fallback/ (flax, optax) is left alone: the image's own are used.
# 2. Runs bench/gpu_check.py with --budget BUDGET (default 420 s) and --out OUT, under
#    a hard stop 120 s past the budget (SIGTERM, which writes the report, then SIGKILL),
#    with jax's compilation cache in /tmp, so a second try on the same machine compiles
#    less. The exit status is gpu_check.py's.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: sh bench/gpu_run.sh OUT [gpu_check.py flags]}
shift
BUDGET=${BUDGET:-420}
PYTHON=${PYTHON:-python3}
SITE=${WHEELS_SITE:-/tmp/moe_jax_site}

if ls .whl/*.whl >/dev/null 2>&1; then
  if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_run: the wheels in .whl/ did not install; running without them" >&2
  fi
fi
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/moe_jax_cache}"
STOP=""
if command -v timeout >/dev/null 2>&1; then
  STOP="timeout -k 20 $((${BUDGET%.*} + 120))"
fi
$STOP "$PYTHON" bench/gpu_check.py --budget "$BUDGET" --out "$OUT" "$@"
