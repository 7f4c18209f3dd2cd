"""Device checks of the kernels and the operator (libra_ext.measure.selfcheck): every usable
GPU backend against the float64 reference in bf16, bottom-right alignment, and the operator with
the CUDA sync debug mode set to error. The CUDA tests are skipped without a GPU (scripts/
gpu_check.sh runs them there and writes their numbers); the CPU tests keep the same checks and
the check script itself working in CI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from libra_ext.attention import kernels
from libra_ext.measure import selfcheck

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@cuda
def test_every_gpu_backend_matches_the_reference_in_bf16():
    backends = [b for b in selfcheck.usable_backends(torch.device("cuda"), torch.bfloat16, 64)
                if b != "reference"]
    assert backends, "no GPU attention backend: PyTorch >= 2.10 provides varlen_attn"
    for case in selfcheck.kernel_cases("cuda", torch.bfloat16, backends):
        assert case["ok"], case


@cuda
def test_gpu_backends_align_causal_tiles_to_the_bottom_right():
    for b in selfcheck.usable_backends(torch.device("cuda"), torch.bfloat16, 64):
        r = selfcheck.alignment("cuda", torch.bfloat16, b)
        assert r["aligned"] == "bottom-right" and r["ok"], r


@cuda
def test_operator_makes_no_hidden_device_sync():
    assert set(selfcheck.sync_free("cuda").values()) == {"ok"}


@cuda
def test_fused_row_ops_run_one_triton_kernel_with_the_torch_ops_results():
    for dtype in (torch.float32, torch.bfloat16):
        r = selfcheck.row_ops("cuda", dtype, rows=1 << 16)
        assert r["triton"] and r["ok"], r


def test_reference_checks_pass_on_cpu():
    cases = selfcheck.kernel_cases("cpu", torch.float32, ["reference"])
    assert cases and all(c["ok"] for c in cases), cases
    r = selfcheck.alignment("cpu", torch.float32, "reference")
    assert r["aligned"] == "bottom-right" and r["err_top_left"] > 0.01


class _LeakyKeylessRows(torch.autograd.Function):
    """The reference kernel, except that its backward hands a zero-key row's output gradient
    on to that row's dQ (as a kernel would that attended such rows to something)."""

    @staticmethod
    def forward(ctx, q, k, v, seg, scale):
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = kernels.ReferenceBackend().attend(*leaves, seg, scale)
        ctx.graph, ctx.seg = (out, leaves), seg
        return out.detach()

    @staticmethod
    def backward(ctx, dout):
        (out, leaves), seg = ctx.graph, ctx.seg
        dq, dk, dv = torch.autograd.grad(out, leaves, dout)
        keyless = selfcheck.keyless_rows(seg)
        dq[keyless] += dout[keyless]
        return dq, dk, dv, None, None


def test_the_kernel_check_fails_a_kernel_that_leaks_through_zero_key_rows(monkeypatch):
    class Leaky(kernels.Backend):
        name = "leaky"

        def attend(self, q, k, v, seg, scale, key=None):
            return _LeakyKeylessRows.apply(q, k, v, seg, scale)

    monkeypatch.setitem(kernels._FACTORIES, "leaky", Leaky)
    cases = selfcheck.kernel_cases("cpu", torch.float32, ["leaky"])
    assert any(c["keyless_rows"] for c in cases)
    # every case without zero-key segments passes; the one with them fails on its gradients
    assert [c["ok"] for c in cases] == [c["keyless_rows"] == 0 for c in cases], cases
    bad = [c for c in cases if c["keyless_rows"]]
    assert all(c["err_out"] <= 1e-5 < c["err_grad"] for c in bad), bad


def test_the_kernel_check_fails_a_kernel_that_reads_head_slices_as_contiguous(monkeypatch):
    class Blind(kernels.Backend):
        name = "blind"

        def attend(self, q, k, v, seg, scale, key=None):
            q, k, v = (torch.as_strided(x, x.shape, torch.empty(x.shape).stride(),
                                        x.storage_offset()) for x in (q, k, v))
            return kernels.ReferenceBackend().attend(q, k, v, seg, scale)

    monkeypatch.setitem(kernels._FACTORIES, "blind", Blind)
    cases = selfcheck.kernel_cases("cpu", torch.float32, ["blind"])
    assert {c["inputs"] for c in cases} == {"contiguous", "views"}
    assert [c["ok"] for c in cases] == [c["inputs"] == "contiguous" for c in cases], cases


@pytest.mark.slow
def test_gpu_check_script_runs_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    p = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--device", "cpu", "--context", "1024",
         "--reps", "1", "--out", str(out)],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    checks = r["checks"]
    assert r["ok"] and checks["kernels"]["status"] == checks["no_host_copies"]["status"] == "pass"
    assert checks["rebuild"]["status"] == "pass" and r["rebuild"][0]["bitwise"]
    assert checks["rowops"]["status"] == "pass" and r["rowops"]["gather_equal"]
    assert checks["train"]["status"] == "skip"  # a skip is reported as one, not as a pass
    assert checks["train_megatron_hybrid"]["status"] == "skip"  # a GPU with TE only
    # Megatron-LM's loop runs where megatron.training is installed (on the CPU: gloo, fp32)
    import importlib.util

    mlm = importlib.util.find_spec("megatron.training") is not None
    assert checks["train_megatron_lm"]["status"] == ("pass" if mlm else "skip"), checks
    assert checks["replay"]["status"] == checks["calibration"]["status"] == "pass"
    lines = [x for x in p.stdout.splitlines() if x.startswith("check ")]
    assert len(lines) == len(checks)  # one summary line per check
    # the presets' median and 10th-percentile sequences and one long document, every system
    assert set(r["overhead"]) == {"libra-256k/p50", "libra-256k/p10", "libra-1m/p50",
                                  "libra-1m/p10", "one-document/1024"}
    for case, res in r["overhead"].items():
        for name in ("libra", "ulysses", "wlb", "distca"):
            s = res["systems"][name]
            assert s["kernel_calls_fwd"] >= 1 and s["host_copies"] == 0, (case, name)
            assert s["operator_ms"] > 0 and s["ratio"] > 0
    assert r["overhead"]["libra-256k/p10"]["cost_over_tokens_squared"] < \
        r["overhead"]["libra-256k/p50"]["cost_over_tokens_squared"]
    assert Path(r["calibration"]["profile"]).is_file()
    for name in ("ulysses", "libra"):
        s = r["replay"]["systems"][name]
        assert len(s["rank_ms"]) == 4 and s["modeled_max_over_mean"] >= 1.0
    # Libra under pairs, the calibrated profile's table and the online fit, side by side
    cm = r["cost_models"]
    assert checks["cost_models"]["status"] == "pass"
    assert set(cm["entries"]) == {"libra", "libra+profile", "libra+online"}
    assert cm["online_fits"] > 0 and len(cm["online_table"]["per_pair"]) == 61
    assert all(e["prediction_error"] >= 0 for e in cm["entries"].values())


def _cost_entry(measured: float, error: float) -> dict:
    return {"measured_max_over_mean": measured, "predicted_max_over_mean": 1.01,
            "prediction_error": error, "split_error": error / 2, "bytes_sent_per_rank": 1.0}


def test_gpu_check_fails_a_wrong_result_and_never_counts_a_skip_as_a_pass():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_check", Path(__file__).resolve().parents[2] / "tools" / "gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    good = {
        "kernels": [{"ok": True}], "alignment": [{"ok": True, "backend": "varlen",
                                                  "aligned": "bottom-right"}],
        "sync": {"libra": "ok"},
        "rebuild": [{"backend": "varlen", "ok": True, "grad_err": 0.0, "bitwise": True,
                     "left_after_release": 65536, "stats_bytes": 64000}],
        "rowops": {"ok": True, "triton": True, "add_err": 0.004, "sum_err": 0.004,
                   "sum_deterministic": True, "gather_ms": {"fused": 1.1, "torch": 1.3},
                   "scatter_ms": {"fused": 1.6, "torch": 2.0}, "sum_ms": 0.4},
        "overhead": {"libra-256k/p50": {"systems": {
            "libra": {"host_copies": 0, "ratio": 1.01}}}},
        "calibration": {"peak_tflops": 400.0, "rows": [{"fwd_tflops": 380.0}]},
        "replay": {"systems": {"ulysses": {"measured_max_over_mean": 1.9,
                                           "modeled_max_over_mean": 1.97, "rank_ms": [9.0, 4.0]},
                               "libra": {"measured_max_over_mean": 1.05,
                                         "modeled_max_over_mean": 1.01, "rank_ms": [5.0, 4.8]}}},
        "cost_models": {"cost_models": ["pairs", "online"], "online_fits": 3,
                        "online_table": {"per_pair": [1e-12] * 61}, "noise_floor": 1.002,
                        "entries": {"libra": _cost_entry(1.08, 0.06),
                                    "libra+online": _cost_entry(1.02, 0.03)}},
        "train": {"rc": 0, "loss_first": 5.5, "loss_last": 4.9},
        "train_megatron_lm": {"rc": 0, "loss_first": 6.2, "loss_last": 5.7},
    }
    checks = gc._checks(good, cpu=False, skip_train=False)
    assert {k: c["status"] for k, c in checks.items()} == {
        "kernels": "pass", "alignment": "pass", "sync": "pass", "rebuild": "pass",
        "rowops": "pass", "no_host_copies": "pass",
        "overhead_within_5pct": "pass", "train": "pass", "train_megatron_lm": "pass",
        "train_megatron_hybrid": "skip",
        "calibration": "pass",
        "replay": "pass", "cost_models": "pass", "multi_rank": "skip"}
    # a fitted table that predicts badly, or balances worse than pairs, fails on a GPU
    for online in (_cost_entry(1.02, 0.25), _cost_entry(1.12, 0.03)):
        worse = {**good, "cost_models": {**good["cost_models"], "entries": {
            "libra": _cost_entry(1.08, 0.06), "libra+online": online}}}
        assert gc._checks(worse, cpu=False, skip_train=False)["cost_models"]["status"] == "fail"
        assert gc._checks(worse, cpu=True, skip_train=False)["cost_models"]["status"] == "pass"
    unfitted = {**good, "cost_models": {**good["cost_models"], "online_fits": 0}}
    assert gc._checks(unfitted, cpu=True, skip_train=False)["cost_models"]["status"] == "fail"
    bad = {
        **good,
        "calibration": {"peak_tflops": 0.0, "rows": [{"fwd_tflops": 0.0}]},
        "replay": {"systems": {"ulysses": {"measured_max_over_mean": 1.9,
                                           "modeled_max_over_mean": 1.97, "rank_ms": [9.0, 4.0]},
                               "libra": {"measured_max_over_mean": 2.4,
                                         "modeled_max_over_mean": 1.01, "rank_ms": [9.0, 2.0]}}},
        "train": {"skipped": "megatron-core is not installed"},
        "train_megatron_lm": {"rc": 1, "stderr_tail": "pretrain_gpt_libra.py: error: ..."},
        # a kernel that keeps copies of its own: the release frees nothing of them
        "rebuild": [{"backend": "varlen", "ok": False, "grad_err": 0.0, "bitwise": True,
                     "left_after_release": 9 << 20, "stats_bytes": 64000}],
        # fused row ops on a GPU without Triton: correct, but a launch per part
        "rowops": {**good["rowops"], "ok": False, "triton": False},
    }
    checks = gc._checks(bad, cpu=False, skip_train=False)
    assert checks["calibration"]["status"] == "fail" and checks["replay"]["status"] == "fail"
    assert checks["rebuild"]["status"] == "fail" and "9437184 B left" in checks["rebuild"]["detail"]
    assert checks["train"] == {"status": "skip", "detail": "megatron-core is not installed"}
    assert checks["train_megatron_lm"]["status"] == "fail"
    assert checks["rowops"]["status"] == "fail" and "triton False" in checks["rowops"]["detail"]

    # on the CPU one round of milliseconds per rank on a shared host is recorded, not judged:
    # Libra measured above Ulysses still passes while the deterministic modeled figures hold;
    # a modeled inversion or a rank without a timing fails
    cpu_res = {**bad, "calibration": {"peak_tflops": 0.01, "rows": [{"fwd_tflops": 0.01}]}}
    checks = gc._checks(cpu_res, cpu=True, skip_train=False)
    assert checks["replay"]["status"] == "pass", checks["replay"]
    assert checks["overhead_within_5pct"]["status"] == "skip"
    inverted = {**cpu_res, "replay": {"systems": {
        "ulysses": {**bad["replay"]["systems"]["ulysses"], "modeled_max_over_mean": 1.0},
        "libra": bad["replay"]["systems"]["libra"]}}}
    assert gc._checks(inverted, cpu=True, skip_train=False)["replay"]["status"] == "fail"
    # a step that raised fails its check with its error; the other steps are judged as they ran
    broken = {**good, "replay": {"error": "RuntimeError: CUDA out of memory"},
              "overhead": {**good["overhead"], "libra-1m/p10": {"error": "RuntimeError: x"}}}
    checks = gc._checks(broken, cpu=False, skip_train=False)
    assert checks["replay"] == {"status": "fail", "detail": "RuntimeError: CUDA out of memory"}
    assert checks["overhead_within_5pct"]["status"] == "fail"
    assert checks["kernels"]["status"] == checks["calibration"]["status"] == "pass"
    untimed = {**cpu_res, "replay": {"systems": {
        "ulysses": {**bad["replay"]["systems"]["ulysses"], "rank_ms": []},
        "libra": bad["replay"]["systems"]["libra"]}}}
    assert gc._checks(untimed, cpu=True, skip_train=False)["replay"]["status"] == "fail"
