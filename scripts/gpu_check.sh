#!/usr/bin/env bash
# GPU checks of the attention runtime on a machine with one NVIDIA GPU and a CUDA build of
# PyTorch (Transformer Engine, flash-attn and megatron-core optional):
#   kernel equivalence and bottom-right alignment of every usable backend, the single-rank
#   operator under torch.cuda.set_sync_debug_mode("error"), the operator against one plain
#   varlen call on a 256K-token packed sequence, and (with megatron-core) a short bf16 run of
#   `libra train` and (with megatron-core >= 0.19) one of pretrain_gpt_libra.py, Megatron-LM's
#   own loop.
# Usage: bash scripts/gpu_check.sh [OUT_JSON]   (default out/gpu_check.json; under 8 minutes)
# WHEELS=DIR installs the wheels in DIR first, into a scratch folder put on PYTHONPATH (a
# machine without a package index: e.g. DIR holding megatron-core's cp312 wheel).
# Builds the C++ planner in place when it does not import. Exit status 1 when a check fails.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ]; then
  site="$(mktemp -d)"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$WHEELS"/*.whl
  export PYTHONPATH="$PYTHONPATH:$site"
  echo "[gpu_check] installed $(ls "$WHEELS"/*.whl | xargs -n1 basename | tr '\n' ' ')into $site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if ! "$py" -c "import libra_ext._planner" >/dev/null 2>&1; then
  echo "[gpu_check] building the planner extension"
  "$py" setup.py -q build_ext --inplace -j "$(nproc)" >/dev/null
fi
"$py" tools/gpu_check.py --out "${1:-out/gpu_check.json}" "${@:2}"
