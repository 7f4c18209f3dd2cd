#!/bin/bash
# Run `libra ARGS...` (or "$LIBRA" ARGS..., e.g. pretrain_gpt_libra.py) on every GPU of the Slurm
# allocation: one torchrun per node (srun), c10d rendezvous on the first node, NCCL over
# InfiniBand. Sourced by the sbatch scripts; usable by hand inside an allocation:
#   bash scripts/slurm/launch.sh train --config FILE ...
#
# The environment on the nodes: the project's virtual environment on a shared filesystem
# (LIBRA_VENV, default the repository's .venv; its torchrun and libra are called by path, so
# nothing needs to be activated), or a container image (LIBRA_CONTAINER_IMAGE, with pyxis /
# enroot's srun --container-image; LIBRA_CONTAINER_MOUNTS adds --container-mounts; inside it
# torchrun and libra come from the image's PATH, as the Dockerfile's).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
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
srun_args=(--kill-on-bad-exit=1)
# srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05): each node's torchrun and its
# workers get the cores the job asked for
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
  srun_args+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
fi
if [ -n "${LIBRA_CONTAINER_IMAGE:-}" ]; then
  srun_args+=(--container-image="$LIBRA_CONTAINER_IMAGE" --container-workdir="$PWD")
  if [ -n "${LIBRA_CONTAINER_MOUNTS:-}" ]; then
    srun_args+=(--container-mounts="$LIBRA_CONTAINER_MOUNTS")
  fi
  TORCHRUN="${TORCHRUN:-torchrun}"
  LIBRA="${LIBRA:-libra}"
else
  venv="${LIBRA_VENV:-$root/.venv}"
  if [ ! -x "$venv/bin/torchrun" ]; then
    echo "launch.sh: no torchrun in $venv/bin: make the environment with scripts/setup_env.sh" \
         "on a filesystem the nodes share, point LIBRA_VENV at one, or run in a container" \
         "(LIBRA_CONTAINER_IMAGE)" >&2
    exit 2
  fi
  TORCHRUN="${TORCHRUN:-$venv/bin/torchrun}"
  LIBRA="${LIBRA:-$venv/bin/libra}"
fi
export GPUS_PER_NODE MASTER_ADDR MASTER_PORT LIBRA TORCHRUN
# The arguments travel as "$@" (an argument that holds spaces stays one argument); "$LIBRA" is
# a path, or a command the node's PATH resolves (in a container).
srun "${srun_args[@]}" bash -c 'exec "$TORCHRUN" \
  --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node="$GPUS_PER_NODE" \
  --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" \
  "$(command -v "$LIBRA" || echo "$LIBRA")" "$@"' libra-launch "$@"
