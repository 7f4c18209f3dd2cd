"""A megatron-core GPTModel whose core attention is Libra's operator: dense SwiGLU, or Qwen3-style
MoE when the model config has experts (moe_topk > 0). The layer spec is Transformer Engine's
(fused layer-norm + linear, grouped expert GEMMs) when TE is usable, megatron-core's local spec
otherwise; either way only `core_attention` is replaced."""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch

from libra_ext.attention.core import LibraCoreAttention, Runtime
from libra_ext.workload import ModelConfig
from megatron.libra import rope
from megatron.libra.config import resolve_impl
from megatron.libra.moe_layer import LibraMoELayer, VarlenMoELayer, link_moe_layers

with warnings.catch_warnings():  # megatron-core's notices about optional TE / apex
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        get_transformer_layer_offset,
    )


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


def check_parallel_agreement(config: TransformerConfig) -> None:
    """Refuse a TransformerConfig whose parallel sizes differ from megatron-core's parallel_state
    (the groups the model's layers actually use), naming the field and both values."""
    if not ps.model_parallel_is_initialized():
        return
    pairs = [
        ("tensor_model_parallel_size", ps.get_tensor_model_parallel_world_size()),
        ("context_parallel_size", ps.get_context_parallel_world_size()),
        ("pipeline_model_parallel_size", ps.get_pipeline_model_parallel_world_size()),
    ]
    if config.num_moe_experts:
        pairs += [
            ("expert_model_parallel_size", ps.get_expert_model_parallel_world_size()),
            ("expert_tensor_parallel_size", ps.get_expert_tensor_parallel_world_size()),
        ]
    for name, have in pairs:
        mine = getattr(config, name)
        if mine is not None and mine != have:
            raise ValueError(
                f"TransformerConfig.{name} = {mine} but megatron-core's parallel_state has "
                f"{have}: build the model with the layout parallel_state was initialised with"
            )
    if config.sequence_parallel and config.tensor_model_parallel_size == 1:
        raise ValueError("TransformerConfig.sequence_parallel needs tensor_model_parallel_size > 1")


def build_gpt(
    model: ModelConfig,
    system: str,
    runtime: Runtime,
    max_seq: int,
    dtype: torch.dtype = torch.float32,
    expert_parallel: int = 1,
    transformer_impl: str = "auto",
    **config_overrides,
) -> GPTModel:
    """GPTModel with `core_attention` replaced by LibraCoreAttention for `system` (one pipeline
    stage: the whole model)."""
    return build_model_chunks(
        model, system, runtime, max_seq, dtype, expert_parallel, transformer_impl,
        **config_overrides,
    )[0]


def build_model_chunks(
    model: ModelConfig,
    system: str,
    runtime: Runtime,
    max_seq: int,
    dtype: torch.dtype = torch.float32,
    expert_parallel: int = 1,
    transformer_impl: str = "auto",
    *,
    pp: int = 1,
    vpp: int = 1,
    init_seed: int = 1234,
    moe=None,
    record_routing: bool = False,
    **config_overrides,
) -> list[GPTModel]:
    """This pipeline rank's model chunks (one, or `vpp` virtual stages), each a GPTModel over its
    layers with Libra's core attention; the embedding on the first stage, the output layer and
    loss on the last.

    Initialisation is a function of (init_seed, global layer number): every transformer layer
    draws its weights from a generator seeded by its global number, the embedding from the
    seed, the output layer after the last layer - so any pp / vpp layout starts from the same
    weights as pp 1 (with CPU initialisation; on-device initialisation draws from
    megatron-core's CUDA RNG tracker as Megatron-LM does).

    `moe` (a MoeConfig) with balancer libra makes every MoE layer a LibraMoELayer on the
    all-gather dispatcher, the layers of each chunk chained for the lookahead (and, with
    `record_routing`, keeping each step's routing)."""
    if moe is not None and moe.balancer == "libra":
        config_overrides.setdefault("moe_token_dispatcher_type", "allgather")

    rope.install()  # THD RoPE from each slot's position: a fixed number of kernels
    impl = resolve_impl(transformer_impl)
    if impl == "transformer_engine":  # TE's fused THD RoPE kernel
        config_overrides.setdefault("apply_rope_fusion", True)
    spec = layer_spec(model, system, runtime, impl, init_seed=init_seed,
                      moe=moe, record_routing=record_routing)
    cfg = transformer_config(
        model,
        dtype,
        expert_parallel,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        **config_overrides,
    )
    check_parallel_agreement(cfg)
    saved = torch.get_rng_state()
    chunks = []
    try:
        torch.manual_seed(init_seed)
        for i in range(vpp):
            vp = i if vpp > 1 else None
            chunks.append(
                GPTModel(
                    config=cfg,
                    transformer_layer_spec=spec,
                    vocab_size=model.vocab,
                    max_sequence_length=max_seq,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=vpp == 1, vp_stage=vp),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=vpp == 1, vp_stage=vp),
                    position_embedding_type="rope",
                    rotary_base=model.rope_base,
                    share_embeddings_and_output_weights=getattr(model, "tie_embeddings", False),
                    vp_stage=vp,
                )
            )
    finally:
        torch.set_rng_state(saved)
    for chunk in chunks:
        # every parameter in `dtype`, as Megatron-LM's Float16Module makes them: megatron-core's
        # local norms create their weights in fp32 whatever params_dtype says, and DDP cannot
        # reduce buffers of mixed dtypes in one coalesced all-reduce
        for param in chunk.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
    if moe is not None and moe.balancer == "libra":

        for chunk in chunks:
            link_moe_layers(chunk)
    return chunks


class SeededTransformerLayer(TransformerLayer):
    """megatron-core's TransformerLayer whose weights come from a generator seeded by its global
    layer number (see build_model_chunks)."""

    def __init__(self, config, submodules, layer_number: int = 1, *args, init_seed: int = 0,
                 **kwargs):
        vp_stage = kwargs.get("vp_stage")
        offset = get_transformer_layer_offset(
            config, vp_stage, ps.get_pipeline_model_parallel_rank()
        )
        torch.manual_seed(init_seed * 100_003 + layer_number + offset)
        super().__init__(config, submodules, layer_number, *args, **kwargs)


def _mlp_as(mlp, cls, **params):
    """The layer spec's MoE entry with `cls` as its module and `params` added: a ModuleSpec
    (megatron-core < 0.19) or a functools.partial of the module (0.19)."""
    if isinstance(mlp, functools.partial):
        return functools.partial(cls, *mlp.args, **{**mlp.keywords, **params})
    mlp.module = cls
    if params:
        mlp.params = dict(mlp.params or {}, **params)
    return mlp


def layer_spec(model: ModelConfig, system: str, runtime: Runtime, impl: str,
               init_seed: int | None = None, moe=None, record_routing: bool = False
               ) -> ModuleSpec:
    """The transformer layer spec of `impl` (local | transformer_engine) with Libra's operator as
    core attention (and, with init_seed, layers seeded by their global number; with a MoeConfig
    whose balancer is libra, LibraMoELayer as the MoE layer)."""
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
    if experts is not None and moe is not None:

        if moe.balancer == "libra":
            spec.submodules.mlp = _mlp_as(
                spec.submodules.mlp, LibraMoELayer, replica_slots=moe.replica_slots,
                local_slots=moe.local_slots, lookahead=moe.lookahead,
                record_routing=record_routing)
        else:  # megatron-core's layer, its all-gather padded for unequal token counts
            spec.submodules.mlp = _mlp_as(spec.submodules.mlp, VarlenMoELayer)
    if init_seed is not None:
        spec.module = SeededTransformerLayer
        spec.params = dict(spec.params or {}, init_seed=init_seed)
    return spec
