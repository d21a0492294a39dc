#!/usr/bin/env bash
# The benchmark at real sizes on a GPU machine, in under 8 minutes, printing the table last:
# SD1.5 at 512², SDXL at 1024², full Flux (12 B) at 1024²; batch 1, bf16; random weights built on
# the GPU (nothing is downloaded). Run from anywhere:
#
#   bash bench/gpu.sh                          # on the GPU machine; results in bench/out/
#   bash bench/gpu.sh --out "$OUT"             # results somewhere else
#   bash bench/gpu.sh --device cpu --small     # a dry run of this same script on a CPU, small models
#
# The host: $COMFYUI_PATH if set, else bench/.host/ComfyUI (laid out by bench/prepare_device.sh,
# which also fetches the wheels a bare GPU image lacks for the host: av, torchsde, trampoline; they
# are installed here into a temporary folder), else ~/comfy/ComfyUI. When no host imports, the
# core-only path runs instead (the pack's rows on a plain-torch DiT, no built-in rows) and says so.
# Extra arguments go to bench/run.py (later ones win), e.g. --models flux --configs builtin_on,pack_full.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G "bench/.host/wheels/*.whl" >/dev/null; then
  site="${TMPDIR:-/tmp}/lowvram-bench-site"
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" bench/.host/wheels/*.whl; then
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu.sh: could not install bench/.host/wheels; the host may not import (then the core path runs)" >&2
  fi
fi
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
"$PY" -c 'import torch; print("torch", torch.__version__, "| cuda:", torch.cuda.is_available() and torch.cuda.get_device_name(0))'
# 420 s for the configurations, plus the host check and the report: under 8 minutes in all.
exec "$PY" bench/run.py --device cuda --size full --models sd15,sdxl,flux --time-limit 420 "$@"
