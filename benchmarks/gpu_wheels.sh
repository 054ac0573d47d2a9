#!/usr/bin/env bash
# The wheels gpu.sh installs on a GPU machine that has Python 3.12 with torch, triton and transformers
# but no package index (issue 21): what slipstream imports there beyond those three (xgrammar, with its
# tvm-ffi runtime and pydantic), gguf, and pytest for the GPU tests, each at the version this checkout's
# .venv runs, for CPython 3.12 on x86-64 Linux. About 8 MB; pass the folder to the device run as carry.
#
#   bash benchmarks/gpu_wheels.sh [DEST]   # default benchmarks/out/wheels (git-ignored)
set -euo pipefail

cd "$(dirname "$0")/.."
DEST=${1:-benchmarks/out/wheels}
PY=${PY:-.venv/bin/python}
PACKAGES="xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection typing-extensions
          gguf requests urllib3 certifi charset-normalizer idna pytest pytest-timeout pluggy iniconfig"
PINNED=$("$PY" -c 'import sys, importlib.metadata as m; print(" ".join(f"{p}=={m.version(p)}" for p in sys.argv[1:]))' \
         $PACKAGES)
mkdir -p "$DEST"
"$PY" -m pip download -q --dest "$DEST" --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any $PINNED
ls "$DEST"
