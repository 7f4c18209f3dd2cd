"""Per-GPU memory estimate of a training layout (`libra memory`).

A model of what megatron-core keeps on the busiest GPU (the first pipeline stage, which holds the
embedding and the most micro-batches in flight; the last stage's logits are counted too, so the
estimate is an upper bound when both differ):

- weights, gradients and optimizer state, per parameter: bf16 - 2 B weight, 4 B fp32 gradient
  buffer, 12 B fp32 main weight and Adam moments (sharded over the data-parallel group with the
  distributed optimizer: the dp x cp ranks for dense weights, the expert-data-parallel ranks for
  experts); fp32 / fp64 - weight, gradient and two moments in that width.
- activations saved for the backward, per token and layer (bf16: 2 B per element): the two
  RMSNorm inputs, the QKV and MLP GEMM inputs (divided by tp with sequence parallelism, else
  replicated), Q/K/V, the Ulysses-layout Q/K/V/O and softmax statistics inside core attention,
  the attention output, and the MLP (SwiGLU: both fc1 halves and the activation) or the MoE
  (router logits; top-k copies of the token at the experts, their fc1 and activation outputs).
  Tokens per rank and micro-batch: context / cp. Micro-batches in flight on the first stage:
  one without PP; min(m, pp) / pp of all layers' worth with 1F1B; 1 + (pp - 1) / (pp * vpp)
  with the interleaved schedule (Megatron-LM's accounting).
- recompute: selective drops what core attention keeps internally (the Ulysses-layout tensors,
  the softmax statistics and the pool exchange buffers; the operator runs again, exchange
  included, in the backward); full keeps only each checkpoint's input (the layer input) and adds
  one layer's working set.
- attention exchange buffers (Libra, DistCA): per layer, what the busiest rank receives and keeps
  for its backward - the moved tiles' Q and K/V prefixes, and the O it computed for them - taken
  from plans of the config's workload.
- WLB-LLM (per-document CP): under keep, core attention keeps its key and value packs in place
  of the Ulysses-layout K and V - every document's K/V prefix that each of the rank's two zigzag
  chunks reads, (2 cp + 1) / (2 cp) of the sequence's K and V per rank (`meta.compile_wlb`) -;
  under owner and rebuild the packs are gathered again in the backward and the rank's own K and V
  are kept instead. At cp = 1 it is one plain call.
- system.attention_memory = owner: no exchange buffers (the moved tiles' Q/K/V/O are kept once,
  by their owner, and shipped again in the backward); rebuild: that, and core attention keeps no
  O of its own either (the kernels' outputs are rebuilt from the layer's output in the
  backward).
- logits: the output layer's bf16 logits and the fp32 softmax the cross-entropy keeps, tokens x
  vocab / tp, on the last stage.

It is a model, not a measurement: allocator slack, communication buffers and kernel workspaces
come on top.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from libra_ext.workload import ModelConfig

DTYPE_BYTES = {"bf16": 2, "fp32": 4, "fp64": 8}


@dataclass
class Layout:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    ep: int = 1
    context: int = 4096
    micro_batches: int = 1
    """m: packed sequences per replica and step."""
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    dtype: str = "bf16"


def parameter_counts(model: ModelConfig, lay: Layout) -> dict:
    """Parameters on the first pipeline rank (embedding included): dense ones (sharded over tp)
    and expert ones (experts / ep per rank)."""
    H, h, hkv, d = model.hidden, model.heads, model.kv_heads, model.head_dim
    T = lay.tp
    attn = (H * (h + 2 * hkv) * d + h * d * H) / T + 2 * H + (2 * d if model.qk_norm else 0)
    if model.moe_topk > 0:
        dense_mlp = 3 * H * model.shared_ffn / T + H * model.experts  # shared expert, router
        experts = model.experts / lay.ep * 3 * H * model.moe_ffn
    else:
        dense_mlp, experts = 3 * H * model.ffn / T, 0.0
    layers = model.layers / lay.pp
    embedding = model.vocab * H / T
    # the first stage holds the input embedding; with pp == 1 also the output layer (unless it
    # is the embedding itself) and the final norm
    tied = getattr(model, "tie_embeddings", False)
    head = embedding + ((0.0 if tied else embedding) + H if lay.pp == 1 else 0.0)
    return {
        "dense": layers * (attn + dense_mlp) + head,
        "expert": layers * experts,
    }


ATTENTION_MEMORY = ("keep", "owner", "rebuild")
"""system.attention_memory's settings, from the fastest to the leanest."""


def check_attention_memory(value: str, field: str = "attention_memory") -> None:
    """A ValueError naming `field` unless `value` is one of ATTENTION_MEMORY."""
    if value not in ATTENTION_MEMORY:
        raise ValueError(f"{field} must be one of {', '.join(ATTENTION_MEMORY)}, got {value!r}")


def kv_kept_per_token(lay: Layout, system: str, attention_memory: str) -> float:
    """K and V rows core attention keeps per token of this rank, each of K and V: one (the
    Ulysses layout, or WLB-LLM's own rows), or WLB-LLM's packs under keep at cp > 1: the
    prefixes its two zigzag chunks read, (2 cp + 1) / (2 cp) of the sequence, that is
    cp + 1/2 rows per token of the rank."""
    if system == "wlb" and attention_memory == "keep" and lay.cp > 1:
        return lay.cp + 0.5
    return 1.0


def activation_bytes_per_token(model: ModelConfig, lay: Layout,
                               attention_memory: str = "keep", system: str = "libra") -> dict:
    """Bytes one layer saves for its backward per token of this rank, by part (with
    `attention_memory` = rebuild, core attention's O is not kept; `system` = wlb: its key and
    value packs, `kv_kept_per_token`)."""
    check_attention_memory(attention_memory)
    kv = kv_kept_per_token(lay, system, attention_memory)
    e = DTYPE_BYTES[lay.dtype]
    H, h, hkv, d = model.hidden, model.heads, model.kv_heads, model.head_dim
    T = lay.tp
    stream = 1.0 / T if lay.sequence_parallel else 1.0  # residual-stream tensors
    parts = {
        "norms_and_gemm_inputs": e * 4 * H * stream,  # 2 norm inputs, QKV and MLP GEMM inputs
        "qkv": e * (h + 2 * hkv) * d / T,
        "attention_output": e * h * d / T,
        # inside core attention: Q, K, V, O in the Ulysses layout (WLB-LLM: its own rows, its
        # K/V packs under keep) and fp32 softmax statistics
        "core_attention": e * ((h if attention_memory != "rebuild" else 0) + h
                               + 2 * hkv * kv) * d / T + 4.0 * h / T,
    }
    if model.moe_topk > 0:
        k, f = model.moe_topk, model.moe_ffn
        parts["mlp"] = (
            4.0 * model.experts  # fp32 router logits
            + e * k * H  # the token's copy at each of its k experts
            + e * k * 3 * f  # their fc1 (gate, up) and activation outputs
            + e * 3 * model.shared_ffn / T
        )
    else:
        parts["mlp"] = e * 3 * model.ffn / T
    return parts


def in_flight(lay: Layout) -> float:
    """All layers' worth of micro-batches the first stage keeps (Megatron-LM's accounting)."""
    if lay.pp == 1:
        return 1.0
    if lay.vpp > 1:
        return 1.0 + (lay.pp - 1) / (lay.pp * lay.vpp)
    return min(lay.micro_batches, lay.pp) / lay.pp


def estimate(model: ModelConfig, lay: Layout, recompute: str = "none",
             recompute_num_layers: int = 1, exchange_bytes_per_layer: float = 0.0,
             attention_memory: str = "keep", system: str = "libra") -> dict:
    """Bytes per GPU, by part, and the total (`attention_memory`: system.attention_memory;
    `system`: system.name, for WLB-LLM's key and value packs)."""
    check_attention_memory(attention_memory)
    if attention_memory != "keep":
        exchange_bytes_per_layer = 0.0  # shipped again in the backward, not kept
    if lay.dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {lay.dtype!r}")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    counts = parameter_counts(model, lay)
    n_params = counts["dense"] + counts["expert"]
    e = DTYPE_BYTES[lay.dtype]
    if lay.dtype == "bf16":
        weights, grads, state = 2.0, 4.0, 12.0
    else:
        weights, grads, state = float(e), float(e), 2.0 * e
    world = lay.tp * lay.cp * lay.pp * lay.dp
    dense_shards = lay.dp * lay.cp if lay.distributed_optimizer else 1
    expert_shards = max(1, world // (lay.ep * lay.pp)) if lay.distributed_optimizer else 1
    optimizer = state * (counts["dense"] / dense_shards + counts["expert"] / expert_shards)

    tokens = lay.context / lay.cp  # per rank and micro-batch
    parts = activation_bytes_per_token(model, lay, attention_memory, system)
    per_layer_full = sum(parts.values()) * tokens + exchange_bytes_per_layer
    layers_total = model.layers  # all layers' worth, times the in-flight factor
    flight = in_flight(lay)
    if recompute == "none":
        activations = per_layer_full * layers_total * flight
    elif recompute == "selective":
        kept = per_layer_full - parts["core_attention"] * tokens - exchange_bytes_per_layer
        activations = kept * layers_total * flight
    else:  # full: each checkpoint's input, plus one checkpoint's working set
        layer_input = e * model.hidden * (1.0 / lay.tp if lay.sequence_parallel else 1.0) * tokens
        activations = (layer_input * layers_total / recompute_num_layers * flight
                       + per_layer_full * recompute_num_layers)
    logits = tokens * model.vocab / lay.tp * (e + 4.0)
    out = {
        "parameters": n_params,
        "weights_bytes": weights * n_params,
        "grads_bytes": grads * n_params,
        "optimizer_bytes": optimizer,
        "activations_bytes": activations,
        "activation_bytes_per_token_layer": sum(parts.values()),
        "exchange_bytes_per_layer": exchange_bytes_per_layer,
        "logits_bytes": logits,
        "in_flight": flight,
    }
    out["total_bytes"] = (out["weights_bytes"] + out["grads_bytes"] + optimizer + activations
                          + logits)
    return out


def exchange_bytes_per_layer(plan) -> float:
    """Bytes of one layer's pool exchange the busiest rank keeps for its backward in a step of
    `plan` (the busiest micro-batch slot): received Q and K/V prefixes, and the O computed for
    moved tiles."""

    px = plan.exchange_pool
    if px == 1 or not plan.xchg_q.any():
        return 0.0
    q, kv, o = (np.asarray(x, dtype=np.float64) for x in (plan.xchg_q, plan.xchg_kv, plan.xchg_o))
    # [G, sender, receiver]: the receiver keeps Q, KV in; as executor also the O it sends back
    kept = q.sum(axis=1) + kv.sum(axis=1) + o.sum(axis=2)  # [G, member]
    return float(kept.max()) * plan.dtype_bytes
