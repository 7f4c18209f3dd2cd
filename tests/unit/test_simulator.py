"""Offline simulator: the step-time formula on a hand-computed example, ablation monotonicity,
config validation and the `libra simulate` / `libra recommend-pool` commands."""

import json
import math

import numpy as np
import pytest
import yaml

from libra_ext.planner import LayoutConfig, Planner, PlannerOptions
from libra_ext.simulator import dcp
from libra_ext.simulator.config import SYSTEMS, SimConfig
from libra_ext.simulator.cost import (
    OPERATOR_LAUNCHES,
    exposed_pool_comm,
    pool_collective_time,
    simulate_plan,
)
from libra_ext.simulator.hardware import HardwareProfile
from libra_ext.simulator.run import run_point
from libra_ext.workload import LengthSource, ModelConfig
from megatron.libra.cli import main

FLAT_HW = {
    "name": "flat",
    "bf16_peak_tflops": 100.0,
    "attention": {
        "peak_tflops": 50.0,
        "curve": [[1, 1.0], [1000000, 1.0]],
        "backward_speed_ratio": 0.5,
        "call_floor_us": 10.0,
    },
    "linear_efficiency": 0.5,
    "gpus_per_node": 8,
    "nvlink": {"bandwidth_gbps": 100.0, "latency_us": 1.0},
    "internode": {"bandwidth_gbps": 10.0, "latency_us": 5.0},
    "allreduce": {"grad_bytes_per_param": 4, "exposed_fraction": 0.5},
}
TINY = ModelConfig(
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    ffn=128,
    layers=2,
    moe_topk=0,
    moe_ffn=0,
    experts=1,
    vocab=100,
)


def test_two_rank_step_time_equals_the_formula():
    hw = HardwareProfile.from_dict(FLAT_HW)
    layout = LayoutConfig(dp=2, cp=1, pool_size=1, context=1000)
    plan = Planner(layout, TINY, PlannerOptions(system="ulysses")).plan([[1000], [300, 200]])
    t = simulate_plan(plan, TINY, hw)
    L, d, h = 2, 16, 4
    lin_per_token = (2 * (64 * (4 + 4) * 16 + 4 * 16 * 64) + 6 * 64 * 128) * 3 * L / (100e12 * 0.5)

    def attn(pairs_per_tile):
        fwd = sum(4 * d * h * p * L for p in pairs_per_tile) / 50e12
        return fwd * (1 + 2.5 / 0.5) + 2 * L * 10e-6  # one varlen call fwd + bwd per layer

    r0 = 1000 * lin_per_token + attn([1000 * 1001 // 2])
    r1 = 500 * lin_per_token + attn([300 * 301 // 2 + 200 * 201 // 2])  # one coalesced tile
    params = TINY.param_count()
    dp = 0.5 * (2 * 1 / 2 * params * 4 / 100e9 + 2 * 1 * 1e-6)  # ring over 2 GPUs in one node
    assert math.isclose(t.rank_total[0, 0], r0, rel_tol=1e-12)
    assert math.isclose(t.rank_total[1, 0], r1, rel_tol=1e-12)
    assert math.isclose(t.dp_exposed, dp, rel_tol=1e-12)
    assert math.isclose(t.step, max(r0, r1) + dp, rel_tol=1e-12)
    assert np.allclose(t.slot[:, 0], [r0, r1])


def test_the_operators_data_path_is_counted_where_ranks_exchange():
    # cp 2 Ulysses: one layout copy on one side of each all-to-all, 4 (Q + K + V) + 4 O bytes
    # per rank, layer and step, at the profile's copy bandwidth, plus the launches beyond a
    # plain call's; at one cp rank nothing (the operator is the plain call)
    hw = HardwareProfile.from_dict({**FLAT_HW, "operator": {"copy_bandwidth_gbps": 1000.0,
                                                            "launch_us": 3.0}})
    assert (hw.copy_bandwidth, hw.launch) == (1e12, 3e-6)
    model = TINY
    plan = Planner(LayoutConfig(dp=1, cp=2, pool_size=1, context=1000), model,
                   PlannerOptions(system="ulysses")).plan([[600, 400]])
    t = simulate_plan(plan, model, hw)
    tokens = 1000 / 2  # per cp rank
    qkv = tokens * (4 + 2 * 2) * 16 * 2  # 4 query, 2 KV heads x 16, bf16
    o = tokens * 4 * 16 * 2
    # (launches: the gate's 8 / 9 Ulysses ops against a plain call's 2 / 3)
    want = ((4 * qkv + 4 * o) / 1e12 + OPERATOR_LAUNCHES["ulysses"] * 3e-6) * model.layers
    assert OPERATOR_LAUNCHES["ulysses"] == 12
    assert np.allclose(t.operator, want, rtol=1e-12)
    one = Planner(LayoutConfig(dp=1, cp=1, pool_size=1, context=1000), model,
                  PlannerOptions(system="ulysses")).plan([[600, 400]])
    assert not simulate_plan(one, model, hw).operator.any()
    # the pool exchange adds its gathers and scatters to what the ranks of a Libra pool move
    layout = LayoutConfig(dp=2, cp=2, pool_size=2, context=1000)
    libra = Planner(layout, model, PlannerOptions(system="libra")).plan([[1000], [100] * 10])
    ulysses = Planner(layout, model, PlannerOptions(system="ulysses")).plan([[1000], [100] * 10])
    assert libra.xchg_q.any()
    assert simulate_plan(libra, model, hw).operator.max() > \
        simulate_plan(ulysses, model, hw).operator.max()


def test_a_step_whose_last_sequence_is_empty_is_simulated():
    """WLB-LLM's repacking can hold back a step's only long document, leaving its last
    sequence without documents: it counts 0 tokens (once an out-of-range read)."""
    model = ModelConfig(hidden=64, heads=8, kv_heads=2, head_dim=8, ffn=64, layers=1,
                        moe_topk=0, moe_ffn=0)
    planner = Planner(LayoutConfig(dp=2, cp=2, pool_size=2, context=4096), model,
                      PlannerOptions(system="wlb", wlb_outlier_len=1000))
    plan = planner.plan([[100], [4000]])
    assert plan.seq_doc_offsets[-1] == plan.seq_doc_offsets[-2]  # the last one is empty
    assert plan.sequence_tokens().tolist() == [100, 0]
    t = simulate_plan(plan, model, HardwareProfile.load("h200-sxm"))
    assert np.isfinite(t.step) and t.step > 0


def test_pipeline_exposure_formula():
    comm, attn = np.array([8.0, 8.0, 0.0]), np.array([100.0, 1.0, 5.0])
    # 4 chunks: first and last chunk exposed (2/4 of comm), middle hidden behind 3/4 of attention
    assert np.allclose(exposed_pool_comm(comm, attn, 4, True), [4.0, 4.0 + 4.0 - 0.75, 0.0])
    assert np.allclose(exposed_pool_comm(comm, attn, 4, False), comm)
    assert (exposed_pool_comm(comm, attn, 4, True) <= comm).all()


def _cfg(tmp_path, **over):
    d = {
        "hardware": "h100-sxm",
        "model": {
            "hidden": 256,
            "heads": 8,
            "kv_heads": 2,
            "head_dim": 32,
            "ffn": 512,
            "layers": 2,
            "moe_topk": 0,
            "moe_ffn": 0,
            "experts": 1,
            "vocab": 1000,
        },
        "steps": 2,
        "dcp_steps": 1,
        "seed": 0,
        "pipeline_chunks": 4,
        "systems": list(SYSTEMS),  # every simulated system and peer
        "reference": "ref.yaml",
        "scenarios": {
            "small": {
                "workload": "libra-256k",
                "context": 16384,
                "gbs": 16,
                "cp": 2,
                "tp": 1,
                "pool_size": 4,
                "dp": [1, 2, 4, 8],
                "pool_sweep": {"dp": 8, "pool_sizes": [2, 4, 8]},
            }
        },
    }
    d.update(over)
    (tmp_path / "ref.yaml").write_text(
        yaml.safe_dump(
            {
                "scenarios": {
                    "small": {
                        "dp_scaling_dp16": {"cite": "test", "libra": 7.0},
                        "exchange_cost": {"cite": "test", 4: 0.1},
                    }
                }
            }
        )
    )
    p = tmp_path / "sim.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def test_ablations_are_monotone(tmp_path):
    cfg = SimConfig.load(_cfg(tmp_path))
    hw = HardwareProfile.load("h100-sxm")
    sc = cfg.scenarios[0]
    src = LengthSource(preset="libra-256k")
    for seed in range(4):
        steps = [src.step(sc.gbs, sc.context, seed, s) for s in range(2)]
        tap = run_point("libra-tap", sc, 8, 4, steps, cfg, hw)
        tap_vrsp = run_point("libra-tap-vrsp", sc, 8, 4, steps, cfg, hw)
        # adding VRSP never raises the inter-pool imbalance on the same input
        assert tap_vrsp.imbalance_after <= tap.imbalance_after + 1e-12
        assert tap.imbalance_before == tap_vrsp.imbalance_before
    # the pipeline only hides exchange: exposed <= transferred, on every rank
    plan = Planner(
        LayoutConfig(dp=8, cp=2, pool_size=4, context=16384), cfg.model, PlannerOptions()
    ).plan(steps[0])
    t = simulate_plan(plan, cfg.model, hw, pipelined=True, chunks=4)
    assert (t.pool_exposed <= t.pool_comm + 1e-15).all() and t.pool_comm.max() > 0


def test_simulate_writes_report_results_and_figures(tmp_path, capsys):
    cfg = _cfg(tmp_path)
    out = tmp_path / "out"
    assert main(["simulate", str(cfg), "--out", str(out), "--json", "--no-progress"]) == 0
    r = json.loads(capsys.readouterr().out)
    s = r["scenarios"]["small"]
    assert r["workload"]["small"] == "libra-256k" and s["workload"] == "libra-256k"
    for system in ("ulysses", "libra", "wlb", "distca", "libra-tap", "libra-tap-vrsp"):
        assert set(s["dp_scaling"][system]) == {"1", "2", "4", "8"}
        assert s["dp_scaling"][system]["1"] == pytest.approx(1.0)
        assert 0 < s["scaling_efficiency_dp16"][system] <= 1.0 + 1e-9
        assert s["attention_latency"][system]["max"] >= s["attention_latency"][system]["mean"]
    assert "megatron-dcp" in s["dp_scaling"] or "megatron-dcp" in s["errors"]
    assert set(s["dp_scaling"]["megatron-dyncp"]) == {"1", "2", "4", "8"}
    assert "| megatron-dyncp |" in (out / "report.md").read_text()
    assert set(s["pool_sweep"]) == {"2", "4", "8"}
    for v in s["pool_sweep"].values():
        assert {"imbalance_before", "imbalance_after", "exchange_cost"} <= set(v)
    assert s["recommended_pool_size"] in (2, 4, 8)
    report = (out / "report.md").read_text()
    assert "| libra |" in report and "paper DP8" in report and "Recommended pool size" in report
    for f in (
        "dp_scaling_small.png",
        "pool_sweep_small.png",
        "rank_attention_small.png",
        "results.json",
    ):
        assert (out / f).stat().st_size > 0


def test_simulate_with_a_lengths_file_names_it(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(x) for x in [50, 400, 3000, 9000, 120, 16000]) + "\n")
    cfg = _cfg(tmp_path, systems=["ulysses", "libra"])
    out = tmp_path / "o"
    assert (
        main(
            [
                "simulate",
                str(cfg),
                "--out",
                str(out),
                "--lengths-file",
                str(lengths),
                "--no-progress",
            ]
        )
        == 0
    )
    assert f"file:{lengths}" in (out / "report.md").read_text()
    assert json.loads((out / "results.json").read_text())["workload"]["small"] == f"file:{lengths}"


def test_recommend_pool(tmp_path, capsys):
    assert main(["recommend-pool", str(_cfg(tmp_path, systems=["libra"])), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["scenarios"]["small"]
    assert r["recommended_pool_size"] in (2, 4, 8)
    best = min(r["pool_sweep"], key=lambda p: r["pool_sweep"][p]["step_time"])
    assert int(best) == r["recommended_pool_size"] and "lowest modeled step time" in r["reason"]


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(systems=["ulysses", "nope"]), r"systems\[1\] = 'nope'"),
        (dict(steps=0), r"config.steps must be an integer >= 1"),
        (dict(bogus=1), r"unknown key 'bogus'"),
        (dict(model={"heads": 8, "kv_heads": 3}), r"model.kv_heads"),
        (dict(model={"layer": 2}), r"model.layer is not a model field"),
    ],
)
def test_bad_config_fields_are_named(tmp_path, over, message):
    with pytest.raises(ValueError, match=message):
        SimConfig.load(_cfg(tmp_path, **over))


def test_bad_scenario_fields_are_named(tmp_path, capsys):
    p = _cfg(tmp_path)
    d = yaml.safe_load(p.read_text())
    d["scenarios"]["small"]["pool_sweep"]["pool_sizes"] = [3]
    p.write_text(yaml.safe_dump(d))
    assert main(["simulate", str(p), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "scenarios.small.pool_sweep.pool_sizes[0] = 3 does not divide" in err
    assert err.count("\n") == 1


def test_hardware_profile_errors():
    bad = dict(FLAT_HW, attention=dict(FLAT_HW["attention"], curve=[[10, 1.0], [5, 0.5]]))
    with pytest.raises(ValueError, match="curve tokens must be positive and increasing"):
        HardwareProfile.from_dict(bad)
    with pytest.raises(ValueError, match="hardware.linear_efficiency is missing"):
        HardwareProfile.from_dict({k: v for k, v in FLAT_HW.items() if k != "linear_efficiency"})
    with pytest.raises(ValueError, match="no profile 'tpu'"):
        HardwareProfile.load("tpu")
    for name in ("h100-sxm", "h200-sxm"):
        hw = HardwareProfile.load(name)
        assert hw.attn_efficiency(np.array([512]))[0] == pytest.approx(0.47, abs=0.05)
        assert hw.attn_efficiency(np.array([65536]))[0] == 1.0


def test_dynamic_cp_schedule_follows_megatrons_decisions_on_hand_worked_cases():
    """Expected assignments worked out by hand from DefaultDynamicCPScheduler's rules."""
    # 8 GPUs, 200 tokens per GPU; workload cap 210 * 200 * 1.05 = 44100.
    # 210 needs 2 GPUs: group A on 0-1 (work 22050, 105 tokens/GPU), the busiest so far.
    # 200 needs 1 GPU, but alone it projects 40000; a new 2-GPU group projects 22050: B on 2-3.
    # 150: 1 GPU projects 22500, joining A 33300, B 31250, a new 2-GPU group 22050: C on 4-5.
    # 30: a new 1-GPU group ties the busiest (22050) first: D on 6. 20 joins D (ties again).
    # GPU 7 is idle: the smallest group (D) doubles onto 6-7.
    assert dcp.dynamic_cp_schedule([210, 200, 150, 30, 20], 8, 200) == [
        [[0], [0], [1], [1], [2], [2], [3, 4], [3, 4]]]
    # 4 GPUs, 100 tokens per GPU: 100, 90, 90, 90 take a GPU each; three 10s fill the 90s'
    # GPUs to 100 tokens; the last 10 has no room and waits. Alone in the next micro-batch it
    # opens a 1-GPU group, doubled to 2 and then 4 GPUs.
    assert dcp.dynamic_cp_schedule([100, 90, 90, 90, 10, 10, 10, 10], 4, 100) == [
        [[0], [1, 4], [2, 5], [3, 6]], [[7], [7], [7], [7]]]
    # 7 GPUs: 400 takes 0-3, 200 takes 4-5; GPU 6 is idle and the 2-GPU group cannot double in
    # place (it would end past GPU 6): one group of all 7 GPUs holds both documents.
    assert dcp.dynamic_cp_schedule([200, 400], 7, 100) == [[[1, 0]] * 7]
    # min_cp 2: each document fits one GPU but takes 2; 40 joining 50's group would project
    # 1250 + 800, a new group 1250 (the busiest): a group each
    assert dcp.dynamic_cp_schedule([50, 40], 4, 100, min_cp=2) == [[[0], [0], [1], [1]]]


def test_dynamic_cp_schedule_places_every_document_once_within_the_token_room():
    rng = np.random.default_rng(3)
    for _ in range(30):
        gpus = int(rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 16]))
        cap = int(rng.integers(64, 4096))
        lengths = [int(x) for x in rng.integers(1, cap * min(gpus, 4) + 1, rng.integers(1, 60))]
        rounds = dcp.dynamic_cp_schedule(lengths, gpus, cap)
        seen = []
        for per_gpu in rounds:
            assert len(per_gpu) == gpus and all(per_gpu)  # no idle GPU in a micro-batch
            holders: dict = {}
            for g, ids in enumerate(per_gpu):
                for i in ids:
                    holders.setdefault(i, []).append(g)
            for i, gs in holders.items():
                k = len(gs)
                assert gs == list(range(gs[0], gs[0] + k))  # a contiguous group
                assert all(per_gpu[g] == per_gpu[gs[0]] for g in gs)
                assert sum(lengths[j] / k for j in per_gpu[gs[0]]) <= cap + 1e-9
            seen.extend(holders)
        assert sorted(seen) == list(range(len(lengths)))


def test_pool_size_that_does_not_divide_dp_is_refused(tmp_path):
    d = yaml.safe_load(_cfg(tmp_path).read_text())
    d["scenarios"]["small"]["dp"] = [1, 2, 4, 6]
    d["scenarios"]["small"]["gbs"] = 12
    with pytest.raises(ValueError, match=r"pool_size = 4 does not divide scenarios.small.dp\[3\]"):
        SimConfig.from_dict(d, base=tmp_path)


def test_too_few_steps_are_noted(tmp_path, capsys):
    cfg = _cfg(tmp_path)
    assert main(["recommend-pool", str(cfg), "--steps", "1", "--no-progress", "--json"]) == 0
    assert "note: 1 sampled step(s)" in capsys.readouterr().err


def test_distca_as_deployed_follows_distcas_layout_and_greedy_on_hand_worked_cases():
    from libra_ext.simulator import distca_gpu

    # one replica, two GPUs of 20 tokens: the 30-token document is cut at the boundary into
    # head/tail pieces - GPU 0 rows [0, 10) and [20, 30), GPU 1 rows [10, 15) and [15, 20)
    L, G, HQ, HK, TQ, TK = distca_gpu.layout_pieces([[30, 10]], 20, 2)
    assert L.tolist() == [30, 30, 10] and G.tolist() == [0, 1, 1]
    assert (HQ.tolist(), HK.tolist(), TQ.tolist(), TK.tolist()) == (
        [10, 5, 10], [10, 15, 10], [10, 5, 0], [30, 20, 0])
    # work 310 / 210 (mean 260): GPU 1 needs 50; GPU 0's piece gives m = floor(50 / 31) = 1 row
    # from each end (rows 9 and 20: 10 + 21 = 31 pairs); 19 more would need a row of 31: stop
    assert distca_gpu.balance([[30, 10]], 20, 2, 0.0, 8, 2).tolist() == [279.0, 241.0]
    # whole documents: GPU 0 holds 6 and 4 (31 pairs), GPU 1 holds 2 and 8 (39); GPU 0 needs 4.
    # bytes per unit of work: the 2-token document (3 pairs, (1*8 + 2*3*2) / 3 = 6.7) beats the
    # 8-token one ((4/9*8 + 2*9*2) / 4 = 9.9) and moves whole; the 1 still missing is less than
    # a row of the 8-token document (9 pairs)
    assert distca_gpu.balance([[6, 4, 2, 8]], 10, 2, 0.0, 8, 2).tolist() == [34.0, 36.0]
    # a tolerance of 1/8 of the mean (35) leaves a deficit of 4 alone
    assert distca_gpu.balance([[6, 4, 2, 8]], 10, 2, 0.125, 8, 2).tolist() == [31.0, 39.0]
    # traffic: the 30-token document lives on both GPUs (rows [0, 10) + [20, 30) on GPU 0,
    # [10, 20) on GPU 1). GPU 1 now serves rows 9 and 20 (2 query rows from GPU 0: each crosses
    # twice each way) and needs keys [0, 21): 11 rows from GPU 0; GPU 0 still serves rows up to
    # key 30 and needs GPU 1's 10 rows. Every row counted at both ends.
    _, layout = distca_gpu.balance([[30, 10]], 20, 2, 0.0, 8, 2, pieces=True)
    assert distca_gpu.traffic(layout, 2).tolist() == [[4.0, 21.0], [4.0, 21.0]]
    # whole documents that stay where they live move nothing
    _, layout = distca_gpu.balance([[6, 4, 2, 8]], 10, 2, 0.125, 8, 2, pieces=True)
    assert distca_gpu.traffic(layout, 2).tolist() == [[0.0, 0.0], [0.0, 0.0]]
    # the micro-batches of a step: one sequence per replica, in the production order
    seqs = [[1], [2], [3], [4]]
    assert distca_gpu.slots_of(seqs, 2, "megatron") == [[[1], [2]], [[3], [4]]]
    assert distca_gpu.slots_of(seqs, 2, "contiguous") == [[[1], [3]], [[2], [4]]]


def test_distca_as_deployed_is_a_simulated_system_beside_the_replica_variant(tmp_path):
    # the same steps through both DistCA variants: every GPU a server (DistCA's own layout,
    # servers inside a replica unequal) never models better balanced attention than one server
    # per replica (the replica's GPUs share its work evenly), and both model all the work
    cfg = SimConfig.load(_cfg(tmp_path))
    hw = HardwareProfile.load("h100-sxm")
    sc = cfg.scenarios[0]
    src = LengthSource(preset="libra-256k")
    steps = [src.step(sc.gbs, sc.context, 3, s) for s in range(2)]
    gpu = run_point("distca", sc, 8, 8, steps, cfg, hw)
    replica = run_point("distca-replica", sc, 8, 8, steps, cfg, hw)
    assert gpu.tokens_per_step == replica.tokens_per_step == sc.gbs * sc.context
    assert math.isfinite(gpu.step_time) and gpu.step_time > 0
    assert len(gpu.rank_attention) == 8 * sc.cp
    assert gpu.attn_max_over_mean >= replica.attn_max_over_mean - 1e-9
    assert {"distca", "distca-replica"} <= set(SYSTEMS)
    assert {"distca", "distca-replica"} <= set(yaml.safe_load(open("configs/sim/libra_paper.yaml"))["systems"])


def test_the_planners_every_gpu_distca_makes_the_simulators_decisions_where_a_gpu_is_a_replica():
    # at cp 1 the planner runs DistCA as deployed (tiles the operator executes): per micro-batch
    # and GPU the same work as the simulator's model of DistCA's planner
    from libra_ext.simulator import distca_gpu

    m = ModelConfig()
    for preset, S, D in (("libra-256k", 65536, 8), ("libra-1m", 131072, 16)):
        src = LengthSource(preset=preset)
        planner = Planner(LayoutConfig(dp=D, cp=1, pool_size=D, context=S), m,
                          PlannerOptions(system="distca", distca_server="gpu"))
        for step in range(2):
            seqs = src.step(2 * D, S, 5, step)
            plan = planner.plan(seqs)
            per = np.zeros((2, D))
            np.add.at(per, (plan.seq_slot[plan.tile_seq], plan.tile_executor), plan.tile_pairs)
            for k, batch in enumerate(distca_gpu.slots_of(seqs.tolist(), D, "megatron")):
                want = distca_gpu.balance(batch, S, D, 0.05, m.heads * m.head_dim,
                                          m.kv_heads * m.head_dim)
                assert np.array_equal(per[k], want), (preset, step, k)
    with pytest.raises(ValueError, match=r"distca_server = gpu .* got cp 2"):
        Planner(LayoutConfig(dp=2, cp=2, pool_size=2, context=4096), m,
                PlannerOptions(system="distca", distca_server="gpu")).plan([[4096]] * 2)
    with pytest.raises(ValueError, match=r"distca_server must be one of replica, gpu; got 'node'"):
        Planner(LayoutConfig(dp=2, cp=1, pool_size=2, context=4096), m,
                PlannerOptions(system="distca", distca_server="node")).plan([[4096]] * 2)


def test_owner_and_rebuild_price_what_they_send_again_in_the_backward():
    # system.attention_memory: owner and rebuild ship each moved unit's Q, K/V and O again with
    # its dO (the pool exchange's bytes from owner to executor: Q + KV + O once more), and
    # rebuild moves the Ulysses O once more; keep is the model as it was
    hw = HardwareProfile.from_dict(FLAT_HW)
    layout = LayoutConfig(dp=2, cp=2, pool_size=2, context=1000)
    libra = Planner(layout, TINY, PlannerOptions(system="libra")).plan([[1000], [100] * 10])
    assert libra.xchg_q.any()
    dt = float(libra.dtype_bytes)
    q, kv, o = (x.astype(np.float64) for x in (libra.xchg_q, libra.xchg_kv, libra.xchg_o))
    keep_send = dt * (q + kv + o + np.swapaxes(o, 1, 2) + np.swapaxes(q, 1, 2)
                      + np.swapaxes(kv, 1, 2))
    again = dt * (q + kv + np.swapaxes(o, 1, 2))

    def busiest(send):  # one group: its busiest member's bytes sent or received
        return np.maximum(send.sum(axis=2), send.sum(axis=1)).max()

    link = hw.link(True)  # cp 2 x pool 2 = 4 GPUs of one node
    keep = pool_collective_time(libra, hw, 4)
    owner = pool_collective_time(libra, hw, 4, "owner")
    assert np.allclose(owner - keep, (busiest(keep_send + again) - busiest(keep_send))
                       / link.bandwidth)
    assert (owner > keep).all()
    assert np.array_equal(pool_collective_time(libra, hw, 4, "rebuild"), owner)
    times = {m: simulate_plan(libra, TINY, hw, attention_memory=m)
             for m in ("keep", "owner", "rebuild")}
    assert times["owner"].pool_comm.sum() > times["keep"].pool_comm.sum()
    assert np.array_equal(times["owner"].cp_comm, times["keep"].cp_comm)
    assert (times["rebuild"].cp_comm > times["owner"].cp_comm).all()  # the Ulysses O again
    # a Ulysses plan has no pool exchange: owner is keep, rebuild adds its O's all-to-all
    uly = Planner(layout, TINY, PlannerOptions(system="ulysses")).plan([[1000], [100] * 10])
    assert simulate_plan(uly, TINY, hw, attention_memory="owner").step == \
        simulate_plan(uly, TINY, hw).step
    assert simulate_plan(uly, TINY, hw, attention_memory="rebuild").step > \
        simulate_plan(uly, TINY, hw).step
    # WLB-LLM's key and value packs are gathered again: its K/V all-gather once more
    wlb = Planner(layout, TINY, PlannerOptions(system="wlb")).plan([[1000], [100] * 10])
    assert (simulate_plan(wlb, TINY, hw, attention_memory="owner").cp_comm >
            simulate_plan(wlb, TINY, hw).cp_comm).all()
    with pytest.raises(ValueError, match="attention_memory must be one of keep, owner, rebuild"):
        simulate_plan(libra, TINY, hw, attention_memory="lean")


def test_the_simulate_config_takes_attention_memory_and_names_a_bad_one(tmp_path):
    assert SimConfig.load(_cfg(tmp_path)).attention_memory == "keep"
    assert SimConfig.load(_cfg(tmp_path, attention_memory="owner")).attention_memory == "owner"
    with pytest.raises(ValueError, match="attention_memory must be one of .* got 'lean'"):
        SimConfig.load(_cfg(tmp_path, attention_memory="lean"))
