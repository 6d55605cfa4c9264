#!/usr/bin/env bash
# The wheels that scripts/gpu_check.sh needs on a GPU machine without a package index, downloaded
# here, where one is reachable (pip's own configuration decides which).
#
# The GPU machines hold torch, Triton, Lightning, einops, tokenizers and tensorboard, but not
# LightningCLI's argument parser: jsonargparse with its `signatures` extra, which Lightning checks
# for by name before `mtp fit` parses anything (docstring-parser and typeshed-client; the extra's
# typing-extensions applies to Python < 3.11 only, and the machines have it anyway). Each is
# pinned to the version the test suite runs with, one version of each, without its dependencies
# (the machine has the rest: PyYAML, typing-extensions), for CPython 3.12 on manylinux x86-64.
#
# The wheels go to .gpu_wheels/ (git-ignored; GPU_WHEELS=DIR elsewhere), which gpu_check.sh
# installs first (`pip install --no-index --no-deps --target`) when it holds any. The folder must
# travel with the working tree to the GPU machine; it stays far below 40 MiB.
#
# Usage: bash scripts/gpu_wheels.sh      (PYTHON=... to pick the interpreter that runs pip)
set -euo pipefail

cd "$(dirname "$0")/.."
DEST="${GPU_WHEELS:-.gpu_wheels}"
PYTHON="${PYTHON:-python3}"
REQUIREMENTS=(jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0)
LIMIT_MIB=40

mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: a stale one beside a new one stops the install there
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --dest "$DEST" \
    "${REQUIREMENTS[@]}"

shopt -s nullglob
wheels=("$DEST"/*.whl)
if ((${#wheels[@]} != ${#REQUIREMENTS[@]})); then
    echo "gpu_wheels: expected ${#REQUIREMENTS[@]} wheels in $DEST, found ${#wheels[@]}" >&2
    exit 1
fi
kib=$(du -sk "$DEST" | cut -f1)
for w in "${wheels[@]}"; do
    printf '%8s KiB  %s\n' "$(($(stat -c %s "$w") / 1024))" "$(basename "$w")"
done
printf '%8s KiB  in %s (limit %s MiB)\n' "$kib" "$DEST" "$LIMIT_MIB"
if ((kib > LIMIT_MIB * 1024)); then
    echo "gpu_wheels: $DEST holds more than $LIMIT_MIB MiB" >&2
    exit 1
fi
