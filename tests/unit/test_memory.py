"""The per-GPU memory model (libra_ext.memory) and `libra memory`."""

import json

import numpy as np
import pytest

from libra_ext.attention import meta
from libra_ext.memory import Layout, estimate, kv_kept_per_token, parameter_counts
from libra_ext.workload import ModelConfig
from megatron.libra.cli import main

QWEN = ModelConfig()  # Qwen3-30B-A3B-like


def test_parameters_add_up_to_the_model_and_shard_as_megatron_does():
    one = parameter_counts(QWEN, Layout())
    assert one["dense"] + one["expert"] == pytest.approx(QWEN.param_count(), rel=0.01)
    ep8 = parameter_counts(QWEN, Layout(ep=8))
    assert ep8["expert"] == pytest.approx(one["expert"] / 8)
    tp2 = parameter_counts(QWEN, Layout(tp=2))
    assert tp2["dense"] < 0.55 * one["dense"] and tp2["expert"] == one["expert"]
    pp2 = parameter_counts(QWEN, Layout(pp=2))
    assert pp2["expert"] == pytest.approx(one["expert"] / 2)


def test_recompute_and_sharding_lower_the_estimate():
    lay = Layout(cp=8, dp=16, ep=8, context=262_144, micro_batches=8, distributed_optimizer=True)
    none, sel, full = (estimate(QWEN, lay, r, 1, 4e8) for r in ("none", "selective", "full"))
    assert full["total_bytes"] < sel["total_bytes"] < none["total_bytes"]
    assert none["activations_bytes"] > 100e9 > full["activations_bytes"]
    plain = estimate(QWEN, Layout(cp=8, dp=16, ep=8, context=262_144, micro_batches=8), "full")
    assert plain["optimizer_bytes"] > 10 * full["optimizer_bytes"]  # sharded over dp x cp
    sp = estimate(QWEN, Layout(tp=2, cp=4, dp=16, ep=8, context=262_144, sequence_parallel=True))
    no_sp = estimate(QWEN, Layout(tp=2, cp=4, dp=16, ep=8, context=262_144))
    assert sp["activations_bytes"] < no_sp["activations_bytes"]
    # 1F1B with fewer micro-batches than stages keeps fewer in flight; interleaving keeps more
    assert estimate(QWEN, Layout(pp=4, micro_batches=2))["in_flight"] == 0.5
    assert estimate(QWEN, Layout(pp=4, vpp=2, micro_batches=8))["in_flight"] == 1.375
    with pytest.raises(ValueError, match="recompute must be none, selective or full"):
        estimate(QWEN, lay, "some")


@pytest.mark.parametrize(
    "name, world", [("qwen3_30b_a3b_256k", 128), ("qwen3_30b_a3b_1m", 256)]
)
def test_the_cluster_configs_fit_an_h200_with_their_recompute(name, world, capsys):
    args = ["memory", "--config", f"configs/train/{name}.yaml", "--world", str(world),
            "--steps", "2", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recompute"] == "full" and out["memory_gb"] == 141
    assert out["estimates"]["full"]["fits"] and not out["estimates"]["none"]["fits"]
    assert out["estimates"]["none"]["exchange_bytes_per_layer"] > 0  # Libra's pool exchange
    assert main(args[:-1] + ["system.name=ulysses"]) == 0
    text = capsys.readouterr().out
    assert "pool exchange kept per layer 0.000 GB" in text and "fits in 141 GB" in text


def test_rebuilding_attention_memory_keeps_no_o_and_no_exchange_buffers():
    lay = Layout(cp=8, dp=16, ep=8, context=262_144, micro_batches=8)
    keep = estimate(QWEN, lay, "none", 1, 4e8)
    lean = estimate(QWEN, lay, "none", 1, 4e8, attention_memory="rebuild")
    o = 2 * QWEN.heads * QWEN.head_dim * lay.context / lay.cp  # bf16 O per layer
    assert keep["activations_bytes"] - lean["activations_bytes"] == pytest.approx(
        (o + 4e8) * QWEN.layers)
    assert lean["exchange_bytes_per_layer"] == 0
    # owner: the exchange buffers go (kept once, by their owner), the kernel's O stays
    owner = estimate(QWEN, lay, "none", 1, 4e8, attention_memory="owner")
    assert keep["activations_bytes"] - owner["activations_bytes"] == pytest.approx(
        4e8 * QWEN.layers)
    assert owner["exchange_bytes_per_layer"] == 0
    with pytest.raises(ValueError, match="attention_memory must be one of keep, owner, rebuild"):
        estimate(QWEN, lay, attention_memory="some")


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_wlb_keeps_its_key_and_value_packs_as_its_programs_gather_them(cp):
    """Under keep, WLB-LLM's core attention keeps the K/V packs its program gathers (the
    prefixes of its two zigzag chunks) instead of one row of K and V per token; under owner and
    rebuild it keeps its own rows, as the Ulysses family does; at cp 1 it is one plain call."""
    lay = Layout(cp=cp, dp=16, ep=8, context=262_144, micro_batches=8)
    lengths = np.array([100_000, 60_000, 50_000, 30_000, 22_144])
    prog = meta.compile_wlb(lengths, cp, 0, QWEN.heads, QWEN.kv_heads, QWEN.head_dim)
    rows = prog.kv.size / prog.call.n_q if cp > 1 else 1.0  # pack rows per token of the rank
    assert kv_kept_per_token(lay, "wlb", "keep") == pytest.approx(rows, rel=1e-3)
    keep, owner = (estimate(QWEN, lay, "none", 1, 0.0, mode, "wlb") for mode in ("keep", "owner"))
    packs = 2 * 2 * QWEN.kv_heads * QWEN.head_dim * (rows - 1) * lay.context / cp * QWEN.layers
    assert keep["activations_bytes"] - owner["activations_bytes"] == pytest.approx(packs,
                                                                                 rel=1e-3)
    libra = estimate(QWEN, lay, "none", 1, 0.0, "owner", "libra")
    assert owner["activations_bytes"] == libra["activations_bytes"]
    # selective recompute drops what core attention keeps, the packs with it
    assert estimate(QWEN, lay, "selective", 1, 0.0, "keep", "wlb")["activations_bytes"] == \
        estimate(QWEN, lay, "selective", 1, 0.0, "keep", "libra")["activations_bytes"]


def test_memory_cli_refuses_a_bad_layout(capsys):
    base = ["memory", "--config", "configs/train/qwen3_30b_a3b_256k.yaml"]
    assert main(base + ["--world", "100"]) != 0
    err = capsys.readouterr().err
    assert "world size 100 must be a multiple of parallel.tp * parallel.cp" in err
    assert main(base + ["--world", "0"]) != 0
    assert "world must be positive" in capsys.readouterr().err
