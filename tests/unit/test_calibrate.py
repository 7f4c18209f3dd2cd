"""`libra calibrate`: a measured attention section in a profile the simulator reads."""

import json

import pytest
import yaml

from libra_ext.simulator.hardware import HardwareProfile
from megatron.libra.cli import main


def test_calibrate_writes_a_profile_the_simulator_loads(tmp_path, capsys):
    out = tmp_path / "cal.yaml"
    args = ["calibrate", "--device", "cpu", "--heads", "2", "--kv-heads", "1", "--head-dim",
            "16", "--lengths", "32,128,512", "--tokens", "1024", "--reps", "1", "--out", str(out),
            "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert [row["tokens"] for row in r["rows"]] == [32, 128, 512]
    assert all(row["fwd_tflops"] > 0 for row in r["rows"])
    assert r["tiles"] and all(t["q"] < t["kv"] for t in r["tiles"])
    hw = HardwareProfile.load(str(out))
    assert hw.measured["device"] == "cpu" and hw.measured["base_profile"] == "h100-sxm"
    assert max(hw.curve_eff) == 1.0 and hw.attn_peak > 0
    assert hw.source.startswith("measured on cpu")
    base = HardwareProfile.load("h100-sxm")
    assert base.source == "published figures" and hw.nvlink == base.nvlink  # kept from --base


def test_profile_with_a_foreign_measured_section_is_refused(tmp_path):
    d = yaml.safe_load(open(HardwareProfile.load.__globals__["HARDWARE_DIR"] / "h100-sxm.yaml"))
    d["measured"] = {"schema": 7, "device": "x", "date": "2026-01-01"}
    with pytest.raises(ValueError, match="measured.schema"):
        HardwareProfile.from_dict(d)
    d["measured"] = {"schema": 1, "device": "", "date": "2026-01-01"}
    with pytest.raises(ValueError, match="measured.device"):
        HardwareProfile.from_dict(d)


def test_calibrate_refuses_bad_lengths(capsys):
    assert main(["calibrate", "--device", "cpu", "--lengths", "512,128"]) == 2
    assert "lengths" in capsys.readouterr().err


def test_calibrate_on_the_cpu_times_one_rank_s_thread_and_leaves_the_threads_as_they_were():
    # deferred: the CLI tests above import no torch
    import torch

    from libra_ext.measure.calibrate import calibrate

    before = torch.get_num_threads()
    kw = dict(device="cpu", dtype="fp32", heads=2, kv_heads=1, head_dim=16, lengths=(32, 64),
              tokens=128, reps=1)
    r = calibrate(**kw)
    assert r["measured"]["threads"] == 1  # a rank's share, as training and the replay time
    assert torch.get_num_threads() == before
    for bad in (0, 1025):
        with pytest.raises(ValueError, match="threads"):
            calibrate(**kw, threads=bad)
    assert torch.get_num_threads() == before
