"""Megatron-Core's hybrid/dynamic context-parallel scheduler as a simulated peer.

The installed megatron-core's `BalancedCPScheduler` (megatron.core.pipeline_parallel.
hybrid_cp_schedule) is fed the step's documents and forms groups of sub-samples over the D x C
GPUs; each document runs on a power-of-two set of GPUs. We time every group with the same cost
model as the other systems: a group is a lock-step micro-batch, so its time is its slowest GPU's.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np

from libra_ext.simulator.hardware import HardwareProfile
from libra_ext.workload import (
    ATTN_BWD_FACTOR,
    LINEAR_BWD_FACTOR,
    ModelConfig,
    linear_fwd_flops_per_token,
)

try:  # megatron-core (and torch) are optional for the simulator
    with warnings.catch_warnings():  # its optional-dependency notices are not ours to print
        warnings.simplefilter("ignore")
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    HAVE_DCP = True
    DCP_ERROR = ""
except Exception as e:  # ImportError, or a torch/megatron import-time failure
    BalancedCPScheduler = None
    HAVE_DCP = False
    DCP_ERROR = f"{type(e).__name__}: {e}"


class _GroupSize:
    """The only thing BalancedCPScheduler reads of its process group."""

    def __init__(self, n: int):
        self._n = n

    def size(self) -> int:
        return self._n


@dataclass
class DcpStep:
    step: float
    """Seconds: sum over groups of the slowest GPU, plus the exposed gradient reduction."""
    gpu_attention: np.ndarray
    """[D*C] attention seconds per GPU over the step."""
    groups: int
    schedule_ms: float


def simulate_dcp_step(
    sequences: list[list[int]],
    dp: int,
    cp: int,
    context: int,
    model: ModelConfig,
    hw: HardwareProfile,
    dp_exposed: float,
    tp: int = 1,
    dtype_bytes: int = 2,
) -> DcpStep:
    """Schedule the step's documents with megatron-core's BalancedCPScheduler and time it."""
    if not HAVE_DCP:
        raise RuntimeError(f"megatron-core's BalancedCPScheduler is not importable ({DCP_ERROR})")
    n_gpus = dp * cp
    docs = [(i, int(l)) for i, l in enumerate(l for s in sequences for l in s)]
    sched = BalancedCPScheduler(
        max_seq_len_per_rank=max(1, context // cp), dp_cp_group=_GroupSize(n_gpus)
    )
    t0 = time.perf_counter()
    _, sample_id_groups = sched.get_groups_and_subsamples(docs, None)
    schedule_ms = (time.perf_counter() - t0) * 1e3
    length = dict(docs)
    L, d, h, hkv = model.layers, model.head_dim, model.heads, model.kv_heads
    lin = (
        linear_fwd_flops_per_token(model)
        * (1 + LINEAR_BWD_FACTOR)
        * L
        / tp
        / (hw.bf16_peak * hw.linear_efficiency)
    )
    total, attn_gpu = 0.0, np.zeros(n_gpus)
    for ids_per_gpu in sample_id_groups:
        holders: dict[int, int] = {}
        for ids in ids_per_gpu:
            for sid in ids:
                holders[sid] = holders.get(sid, 0) + 1
        group_time = 0.0
        for g, ids in enumerate(ids_per_gpu):
            t = 0.0
            for sid in ids:
                l, k = length[sid], holders[sid]
                pairs = l * (l + 1) / 2.0
                eff = float(hw.attn_efficiency(np.array([l]))[0])
                a = 4.0 * d * (h / tp) * pairs * L / k / (hw.attn_peak * eff)
                a *= 1.0 + ATTN_BWD_FACTOR / hw.attn_bwd_speed
                a += 2 * L * hw.call_floor
                attn_gpu[g] += a
                t += a + (l / k) * lin
                if k > 1:  # per-document CP inside the sub-group: KV all-gather, dKV reduce-scatter
                    link = hw.link(k * tp <= hw.gpus_per_node)
                    kv_bytes = (k - 1) * (l / k) * 2 * hkv / tp * d * dtype_bytes * 2
                    t += (kv_bytes / link.bandwidth + 4 * (k - 1) * link.latency) * L
            group_time = max(group_time, t)
        total += group_time
    return DcpStep(
        step=total + dp_exposed,
        gpu_attention=attn_gpu,
        groups=len(sample_id_groups),
        schedule_ms=schedule_ms,
    )
