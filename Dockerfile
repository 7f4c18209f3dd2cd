# Libra on an NGC PyTorch base: CUDA, cuDNN, NCCL, PyTorch, Transformer Engine and apex come with
# the base image (Python 3.12); megatron-core 0.19.2 (with megatron.training, which
# pretrain_gpt_libra.py runs on), transformers, flash-attn and this package are added.
#   docker build -t libra .
#   docker run --gpus all --ipc=host -v /data:/data libra libra train --config configs/train/qwen3_30b_a3b_256k.yaml
FROM nvcr.io/nvidia/pytorch:25.09-py3

ENV PIP_NO_CACHE_DIR=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1
WORKDIR /opt/libra
RUN pip install "megatron-core==0.19.2" psutil "tokenizers>=0.19" "transformers>=4.45" && \
    MAX_JOBS=8 pip install --no-build-isolation "flash-attn>=2.6"
COPY . /opt/libra
RUN pip install --no-build-isolation -e . && \
    python -c "import libra_ext._planner, megatron.core, transformer_engine, flash_attn"
CMD ["libra", "--help"]
