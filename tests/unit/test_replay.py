"""`libra bench replay`: every rank's kernel calls under a plan, measured on one device."""

import json

import numpy as np
import pytest
import torch

from libra_ext.measure import replay
from libra_ext.planner import LayoutConfig, Planner, PlannerOptions
from libra_ext.workload import ModelConfig
from megatron.libra.cli import main

MODEL = ModelConfig(heads=4, kv_heads=2, head_dim=16)
LAYOUT = LayoutConfig(dp=4, cp=2, pool_size=2, context=1024)


def _steps():
    # eight packed sequences of very different attention work
    return [[[1000], [10] * 100, [500, 500], [100] * 10, [900, 100], [20] * 50, [300] * 3,
             [1024]]]


def test_rank_calls_cover_exactly_the_plans_attention_pairs():
    # the calls a rank makes hold the causal pairs of the tiles it executes (one head slice)
    seqs = _steps()[0]
    for system in ("ulysses", "libra", "distca"):
        plan = Planner(LAYOUT, MODEL, PlannerOptions(system=system)).plan(seqs)
        for r in range(LAYOUT.dp):
            calls = replay.rank_calls(plan, r, 0, MODEL)
            pairs = 0
            for c in calls:
                ql, kl = np.diff(c.cu_q), np.diff(c.cu_k)
                # (segments without keys - rows another call or rank runs - hold none)
                pairs += int(np.where(kl > 0, (kl - ql) * ql + ql * (ql + 1) // 2, 0).sum()) * c.hc
            mine = plan.tile_executor == r
            want = int((plan.tile_pairs[mine] * plan.tile_head_count[mine]).sum())
            assert pairs == want, (system, r)


def test_replay_reports_measured_and_modeled_balance_per_system():
    threads = torch.get_num_threads()
    r = replay.run(_steps(), LAYOUT, MODEL, ["ulysses", "libra", "wlb"], device="cpu",
                   dtype="fp32", rounds=2)
    assert r["backend"] and r["steps"] == 1 and r["rounds"] == 2 and r["threads"] == 1
    assert torch.get_num_threads() == threads  # one thread while measuring, then restored
    for name, x in r["systems"].items():
        ranks = LAYOUT.dp * (LAYOUT.cp if name == "wlb" else 1)
        assert len(x["rank_ms"]) == ranks and min(x["rank_ms"]) > 0
        assert x["round_spread"] >= 0.0
        assert x["measured_max_over_mean"] >= 1.0 and x["modeled_max_over_mean"] >= 1.0
        assert x["tiling_efficiency"] > 0 and x["kernel_calls"] > 0
    assert r["systems"]["libra"]["modeled_max_over_mean"] < r["systems"]["ulysses"][
        "modeled_max_over_mean"
    ]
    assert r["systems"]["libra"]["bytes_sent_per_rank"] > 0


def test_replay_command_json_and_bad_system(capsys):
    args = ["bench", "replay", "--workload", "libra-256k", "--context", "1024", "--gbs", "4",
            "--dp", "2", "--cp", "2", "--pool-size", "2", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--system", "ulysses,libra-no-tap", "--rounds", "1",
            "--cost-model", "pairs,online", "--no-progress", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["systems"]) == {"ulysses", "libra-no-tap", "ulysses+online",
                                   "libra-no-tap+online"}
    assert out["layout"]["dp"] == 2 and out["cost_models"] == ["pairs", "online"]
    for x in out["systems"].values():
        assert x["predicted_max_over_mean"] >= 1.0 and 0 <= x["prediction_error"] < 1.0
        assert 0 <= x["split_error"] < 1.0
    # the host's floor: one rank's calls timed as each of the layout's ranks
    nf = out["noise_floor"]
    assert nf["system"] == "ulysses" and len(nf["per_step"]) == 1
    assert nf["per_step"][0]["copies"] == 2 and nf["measured_max_over_mean"] >= 1.0
    # every replayed rank taught the online fit; its table is in the report
    assert out["online_fits"] >= 1 and len(out["online_table"]["per_pair"]) == 61
    with pytest.raises(ValueError, match="cost_models\\[1\\] = 'nope'"):
        replay.run(_steps(), LAYOUT, MODEL, ["ulysses"], cost_models=("pairs", "nope"))
    with pytest.raises(ValueError, match="needs a hardware profile"):
        replay.run(_steps(), LAYOUT, MODEL, ["ulysses"], cost_models=("profile",))
    with pytest.raises(ValueError, match="systems\\[0\\]"):
        replay.run(_steps(), LAYOUT, MODEL, ["nope"])
    with pytest.raises(ValueError, match="rounds must be positive"):
        replay.run(_steps(), LAYOUT, MODEL, ["ulysses"], rounds=0)
    assert main(args[:-1] + ["--rounds", "0", "--json"]) != 0
    assert "rounds must be positive, got 0" in capsys.readouterr().err


def test_noise_floor_times_one_ranks_calls_once_per_rank(monkeypatch):
    # the median-load rank's calls, as many times per round as the layout has ranks
    plan = Planner(LAYOUT, MODEL, PlannerOptions(system="ulysses")).plan(_steps()[0])
    load = plan.rank_load[:, 0]
    median_rank = int(np.argsort(load, kind="stable")[len(load) // 2])
    timed = []
    timer = replay.Timer(torch.device("cpu"), torch.float32, MODEL.head_dim)
    monkeypatch.setattr(timer, "ms", lambda calls: timed.append(calls) or 10.0 + len(timed))
    out = replay.noise_floor(plan, MODEL, timer, rounds=3)
    want = replay.rank_calls(plan, median_rank, 0, MODEL)
    assert out["rank"] == [median_rank, 0] and out["copies"] == LAYOUT.dp
    assert len(timed) == 3 * LAYOUT.dp
    for calls in timed:
        assert [(c.hc, c.cu_q.tolist(), c.cu_k.tolist()) for c in calls] == [
            (c.hc, c.cu_q.tolist(), c.cu_k.tolist()) for c in want]
    # copy i of round k took 10 + k * dp + i + 1: medians 10 + dp + i + 1
    ms = 10.0 + LAYOUT.dp + np.arange(1, LAYOUT.dp + 1)
    assert out["measured_max_over_mean"] == pytest.approx(ms.max() / ms.mean())
    with pytest.raises(ValueError, match="rounds must be positive"):
        replay.noise_floor(plan, MODEL, timer, rounds=0)
