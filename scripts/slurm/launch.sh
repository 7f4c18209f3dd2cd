#!/bin/bash
# Run `libra ARGS...` on every GPU of the Slurm allocation: one torchrun per node (srun),
# c10d rendezvous on the first node, NCCL over InfiniBand. Sourced by train.sbatch and ab.sbatch;
# usable by hand inside an allocation:  bash scripts/slurm/launch.sh train --config FILE ...
set -euo pipefail
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
# the first node; sed reads the whole list (head would exit early and, under pipefail, the
# SIGPIPE of a long list's writer would end the job)
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"
MASTER_PORT="${MASTER_PORT:-29500}"
# NCCL: InfiniBand, GPU-direct RDMA, and a clear error instead of a hang on a failed peer.
export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-0}"
export NCCL_NET_GDR_LEVEL="${NCCL_NET_GDR_LEVEL:-PHB}"
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
# Inside the container of the Dockerfile, or with the repository's .venv on a shared filesystem.
LIBRA="${LIBRA:-libra}"
export GPUS_PER_NODE MASTER_ADDR MASTER_PORT LIBRA
# The arguments travel as "$@" (an override that holds spaces stays one argument); the node's own
# shell resolves the libra executable.
srun --kill-on-bad-exit=1 bash -c 'exec torchrun \
  --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node="$GPUS_PER_NODE" \
  --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" \
  "$(command -v "$LIBRA")" "$@"' libra-launch "$@"
