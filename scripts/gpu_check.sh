#!/usr/bin/env bash
# GPU checks of the attention runtime, for a machine with an NVIDIA GPU:
#   1. single-GPU backend equivalence tests (whichever of flash-attn / PyTorch GPU are present);
#   2. the operator against plain varlen attention on one 256K packed sequence (world size 1,
#      every tile executed locally), timed side by side in one run;
#   3. a short training run on this GPU (NCCL, bf16, distributed optimizer, the Transformer
#      Engine layer spec when TE imports, flash-attn when present), loss written per step.
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
# 3: 10 steps of the tiny model on one GPU; the log line names the kernel backend.
"$py" -m torch.distributed.run --standalone --nproc-per-node=1 -m megatron.libra.cli train \
  --config configs/train/cpu_tiny.yaml parallel.cp=1 parallel.pool_size=1 data.gbs=2 \
  data.context=4096 dtype=bf16 optimizer.distributed=true schedule.train_steps=10 \
  schedule.warmup_steps=2 logging.log_interval=1 logging.metrics_file=out/gpu_train.jsonl
