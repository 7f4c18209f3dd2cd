#!/bin/bash
# Megatron-LM's GPT launch, as its examples write it (argument groups for the model, training,
# model parallelism, data, evaluation and logging), shrunk to a tiny model on 4 CPU processes
# with gloo, with Libra's arguments added. Every change a CPU run needs is marked "CPU:" and
# every Libra argument "Libra:"; on GPUs drop the CPU lines and put the fused kernels, mixed
# precision and NCCL back.
#   bash scripts/pretrain_gpt_cpu.sh CHECKPOINT_DIR TENSORBOARD_DIR [more arguments...]
# (about a minute on 2 cores; arguments after the two directories win over the ones below)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH="${1:?usage: bash scripts/pretrain_gpt_cpu.sh CHECKPOINT_DIR TENSORBOARD_DIR [args...]}"
TENSORBOARD_LOGS_PATH="${2:?usage: bash scripts/pretrain_gpt_cpu.sh CHECKPOINT_DIR TENSORBOARD_DIR [args...]}"
shift 2
py="${PYTHON:-$root/.venv/bin/python}"

DISTRIBUTED_ARGS=(--nproc-per-node 4 --nnodes 1 --master-addr localhost
                  --master-port "${MASTER_PORT:-6000}")
GPT_MODEL_ARGS=(
  --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 512
  --max-position-embeddings 512
  --transformer-impl local          # CPU: megatron-core's local layers (no Transformer Engine)
)
TRAINING_ARGS=(
  --micro-batch-size 1              # Libra: one packed sequence per micro-batch (THD)
  --global-batch-size 8 --train-iters 20 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --init-method-std 0.006 --clip-grad 1.0
  --lr 6.0e-4 --lr-decay-style cosine --min-lr 6.0e-5 --lr-warmup-fraction .1
  --lr-decay-iters 20
  # CPU: no --fp16 / --bf16 (megatron-core's mixed precision keeps fp32 main weights on CUDA
  # devices only); fp32 throughout
  --use-cpu-initialization          # CPU: weights made on the host
  --no-gradient-accumulation-fusion # CPU: a CUDA (apex) kernel
  --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion
  --no-persist-layer-norm           # CPU: fused CUDA kernels
)
MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2
  --context-parallel-size 2         # Libra: its operator runs the CP (Ulysses all-to-all)
)
LIBRA_ARGS=(
  --libra-system libra              # Libra: the system (ulysses, wlb, distca: the baselines)
  --libra-pool-size 1               # Libra: replicas per pool (must divide dp = 1 here)
)
DATA_ARGS=(
  # CPU: Megatron's mock data and a null tokenizer stand for --data-path with GPT-2's
  # --vocab-file / --merge-file (no files to fetch); a real dataset works the same way
  --mock-data --tokenizer-type NullTokenizer --vocab-size 512
  --split 949,50,1
)
EVAL_AND_LOGGING_ARGS=(
  --log-interval 1 --save-interval 10 --eval-interval 10 --eval-iters 2
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH"
  --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)
CPU_ARGS=(--distributed-backend gloo)  # CPU: gloo (NCCL needs GPUs)

cd "$root"
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" exec "$py" -m torch.distributed.run \
  "${DISTRIBUTED_ARGS[@]}" pretrain_gpt_libra.py \
  "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${LIBRA_ARGS[@]}" \
  "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "${CPU_ARGS[@]}" "$@"
