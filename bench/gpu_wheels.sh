#!/bin/sh
# Downloads, on a machine with a package index, the wheels an offline GPU machine lacks
# (`make gpu-wheels`; docs/kernels-and-benchmarks.md#gpu-checks has the install there):
#   DIR/           ml_collections (config files), grain and its array_record,
#                  cloudpickle and portpicker, tensorboardX (a training run);
#   DIR/fallback/  flax and optax at the pinned versions, for an image with older ones
#                  (installing them over an image's own flax is not needed otherwise).
# Versions: the pins of requirements.txt; grain's own dependencies at the versions the
# pinned grain resolves to. Wheels for CPython 3.12 on x86-64 Linux, whatever runs this.
set -eu
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYTHON=${PYTHON:-python3}

pin() {  # the `name==version` line of requirements.txt, without its comment
  grep -i "^$1==" requirements.txt | sed 's/[[:space:]]*#.*//'
}

download() {  # download DEST PACKAGE...
  dest=$1
  shift
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" "$@"
}

download "$DIR" "$(pin ml-collections)" "$(pin grain)" array-record==0.8.6 cloudpickle==3.1.3 \
  portpicker==1.6.0 "$(pin tensorboardX)"
download "$DIR/fallback" "$(pin flax)" "$(pin optax)"
ls "$DIR" "$DIR/fallback"
