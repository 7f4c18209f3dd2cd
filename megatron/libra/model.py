"""A megatron-core GPTModel whose core attention is Libra's operator: dense SwiGLU, or Qwen3-style
MoE when the model config has experts (moe_topk > 0). The layer spec is Transformer Engine's
(fused layer-norm + linear, grouped expert GEMMs) when TE is usable, megatron-core's local spec
otherwise; either way only `core_attention` is replaced."""

from __future__ import annotations

import dataclasses
import warnings

import torch

from libra_ext.attention.core import LibraCoreAttention, Runtime
from libra_ext.workload import ModelConfig
from megatron.libra.config import resolve_impl

with warnings.catch_warnings():  # megatron-core's notices about optional TE / apex
    warnings.simplefilter("ignore")
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig


def transformer_config(
    model: ModelConfig, dtype: torch.dtype = torch.float32, expert_parallel: int = 1, **overrides
) -> TransformerConfig:
    """megatron-core TransformerConfig of a GQA / RoPE / SwiGLU model, dense or MoE."""
    kw = dict(
        num_layers=model.layers,
        hidden_size=model.hidden,
        num_attention_heads=model.heads,
        num_query_groups=model.kv_heads,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.ffn,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        qk_layernorm=model.qk_norm,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # No dropout (as in current long-context pretraining recipes): a sample's computation
        # must not depend on which replica runs it or on the RNG stream, or placement would
        # change the loss and a resumed run would not repeat an uninterrupted one.
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if model.moe_topk > 0:  # Qwen3-style MoE: routed experts (+ optional shared expert)
        kw.update(
            num_moe_experts=model.experts,
            moe_router_topk=model.moe_topk,
            moe_ffn_hidden_size=model.moe_ffn,
            moe_shared_expert_intermediate_size=model.shared_ffn or None,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-3,
            expert_model_parallel_size=expert_parallel,
            # With experts spread over ranks, tokens travel to their experts by all-to-all on GPU
            # (megatron-core's all-to-all dispatcher overlaps on CUDA streams); on CPU, and
            # without expert parallelism, by all-gather.
            moe_token_dispatcher_type=(
                "alltoall" if expert_parallel > 1 and torch.cuda.is_available() else "allgather"
            ),
        )
    if "rotary_base" in {f.name for f in dataclasses.fields(TransformerConfig)}:
        kw["rotary_base"] = model.rope_base  # a TransformerConfig field in newer megatron-core
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt(
    model: ModelConfig,
    system: str,
    runtime: Runtime,
    max_seq: int,
    dtype: torch.dtype = torch.float32,
    expert_parallel: int = 1,
    transformer_impl: str = "auto",
) -> GPTModel:
    """GPTModel with `core_attention` replaced by LibraCoreAttention for `system`."""
    spec = layer_spec(model, system, runtime, resolve_impl(transformer_impl))
    return GPTModel(
        config=transformer_config(model, dtype, expert_parallel),
        transformer_layer_spec=spec,
        vocab_size=model.vocab,
        max_sequence_length=max_seq,
        position_embedding_type="rope",
        rotary_base=model.rope_base,
    )


def layer_spec(model: ModelConfig, system: str, runtime: Runtime, impl: str) -> ModuleSpec:
    """The transformer layer spec of `impl` (local | transformer_engine) with Libra's operator as
    core attention."""
    experts = model.experts if model.moe_topk > 0 else None
    if impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=experts is not None, qk_layernorm=model.qk_norm
        )
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=experts,
            moe_grouped_gemm=False,
            qk_layernorm=model.qk_norm,
            normalization="RMSNorm",
        )
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=LibraCoreAttention, params={"system": system, "runtime": runtime}
    )
    return spec
