#!/usr/bin/env bash
# GPU checks of the attention runtime, for a machine with an NVIDIA GPU:
#   1. single-GPU backend equivalence tests (whichever of flash-attn / PyTorch GPU are present);
#   2. the operator against plain varlen attention on one 256K packed sequence (world size 1,
#      every tile executed locally), timed side by side in one run.
# Usage: bash scripts/gpu_check.sh [CONTEXT]   (writes out/gpu_check.json)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-.venv/bin/python}"
[ -x "$py" ] || py=python3
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name())"
"$py" -m pytest -q tests/test_attention_gpu.py
mkdir -p out
"$py" tools/gpu_bench_attention.py --context "${1:-262144}" --out out/gpu_check.json
