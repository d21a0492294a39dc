#!/usr/bin/env bash
# Lays out, inside the repository, what bench/gpu.sh needs on a GPU machine without network:
#
#   bench/.host/ComfyUI   a copy of the ComfyUI host (no .git, tests, models or user folders), ~15 MB
#   bench/.host/wheels    wheels of the host's imports that a bare GPU image lacks (av, torchsde,
#                         trampoline), for the GPU machine's Python (default 3.12, x86-64 manylinux)
#
#   bash bench/prepare_device.sh [COMFYUI_FOLDER] [PYTHON_VERSION]
#
# COMFYUI_FOLDER defaults to $COMFYUI_PATH, then ~/comfy/ComfyUI. bench/.host is gitignored
# (bench/.gitignore), so a tool that copies the repository must be told to carry it, e.g. the
# device tool's carry: ["bench/.host"]. The wheels need pip and network here; without them the
# copy is still laid out (SKIP_WHEELS=1 skips them on purpose) and gpu.sh falls back to the core path if the host does not import there.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:-${COMFYUI_PATH:-$HOME/comfy/ComfyUI}}
pyver=${2:-3.12}
dest=bench/.host
if [ ! -f "$src/main.py" ] || [ ! -f "$src/comfy/model_patcher.py" ]; then
  echo "prepare_device.sh: no ComfyUI at $src (give its folder as the first argument)" >&2
  exit 2
fi
rm -rf "$dest/ComfyUI"
mkdir -p "$dest/ComfyUI" "$dest/wheels"
tar -C "$src" --exclude=./.git --exclude=./tests --exclude=./tests-unit --exclude=./models --exclude=./input \
  --exclude=./output --exclude=./user --exclude=./temp --exclude=./custom_nodes --exclude='__pycache__' -cf - . \
  | tar -C "$dest/ComfyUI" -xf -
mkdir -p "$dest/ComfyUI/custom_nodes" "$dest/ComfyUI/models"
echo "host copied: $dest/ComfyUI ($(du -sh "$dest/ComfyUI" | cut -f1))"
if [ -n "${SKIP_WHEELS:-}" ]; then
  echo "bench/.host: $(du -sh "$dest" | cut -f1) (SKIP_WHEELS set: no wheels fetched)"
  exit 0
fi
platforms=""
for n in 17 27 28 31 34; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
if python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    $platforms --platform manylinux2014_x86_64 -d "$dest/wheels" av torchsde trampoline; then
  echo "wheels: $(ls "$dest/wheels" | tr '\n' ' ')"
else
  echo "prepare_device.sh: could not download the wheels (no network?); the host may not import on a bare GPU image" >&2
fi
echo "bench/.host: $(du -sh "$dest" | cut -f1) in all (the device tool carries at most 64 MiB with the repository)"
