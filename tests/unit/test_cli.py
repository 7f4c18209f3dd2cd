"""The `libra` command line: JSON output, tables, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from megatron.libra.cli import main

SMALL = [
    "--gbs",
    "16",
    "--dp",
    "4",
    "--cp",
    "2",
    "--pool-size",
    "2",
    "--context",
    "32768",
    "--steps",
    "2",
]


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("system", ["libra", "ulysses", "wlb", "distca"])
def test_plan_json_has_the_contract_keys(capsys, system):
    r = _json(capsys, ["plan", "--system", system, *SMALL, "--json"])
    for key in (
        "system",
        "steps",
        "inter_pool_imbalance",
        "inter_pool_imbalance_before",
        "vrsp_lower_bound_ratio",
        "max_over_mean",
        "max_over_mean_before",
        "moved_token_fraction",
        "bytes_moved_per_rank",
        "plan_ms",
        "pairs_exact",
        "samples_preserved",
    ):
        assert key in r, key
    assert r["system"] == system and r["steps"] == 2
    assert r["pairs_exact"] is True and r["samples_preserved"] is True


def test_plan_libra_beats_ulysses_on_the_same_steps(capsys):
    lib = _json(capsys, ["plan", "--system", "libra", *SMALL, "--json"])
    uly = _json(capsys, ["plan", "--system", "ulysses", *SMALL, "--json"])
    assert lib["max_over_mean_before"] == uly["max_over_mean"]
    assert lib["max_over_mean"] < uly["max_over_mean"]


def test_plan_table_and_lengths_file(capsys, tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(str(x) for x in [100, 5000, 20000, 300, 64]) + "\n")
    assert main(["plan", "--lengths-file", str(f), *SMALL]) == 0
    out = capsys.readouterr().out
    assert f"workload=file:{f}" in out and "per-rank attention max/mean" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--pool-size", "3"], "pool_size (P=3) must divide dp (D=16)"),
        (["plan", "--gbs", "100"], "gbs (B=100) must be a positive multiple of dp (D=16)"),
        (["plan", "--heads", "12"], "model.heads (h=12) must be divisible by cp*tp (8)"),
        (["plan", "--block", "0"], "block must be a positive integer, got 0"),
        (["plan", "--steps", "0"], "steps must be positive"),
        (["plan", "--workload", "nope"], "invalid choice: 'nope'"),
        (["plan", "--dp", "x"], "invalid int value: 'x'"),
    ],
)
def test_plan_errors_exit_2_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) if "invalid" in message else _no_exit():
        code = main(argv)
        assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "is empty"),
        ("10\nabc\n", "line 2: 'abc' is not a positive integer"),
    ],
)
def test_lengths_file_errors(capsys, tmp_path, text, message):
    f = tmp_path / "l.txt"
    f.write_text(text)
    assert main(["plan", "--lengths-file", str(f), "--context", "1000"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_lengths_file_needs_a_context(capsys, tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("10\n")
    assert main(["plan", "--lengths-file", str(f)]) == 2
    assert "context: --context is required" in capsys.readouterr().err


def test_console_script_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "megatron.libra.cli", "plan", *SMALL, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout)["pairs_exact"] is True


def test_bench_planner_json(capsys):
    r = _json(capsys, ["bench", "planner", "--steps", "2", "--python-steps", "1", "--json"])
    for case in ("256k", "1m"):
        c = r["cases"][case]
        assert c["identical"] is True
        assert c["cpp_ms"] > 0 and c["python_ms"] > 0 and c["speedup"] > 1


class _no_exit:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bench_attention_compares_the_operator_with_one_varlen_call(capsys):
    from megatron.libra.cli import main

    argv = ["bench", "attention", "--device", "cpu", "--dtype", "fp32", "--context", "512",
            "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--reps", "1", "--json"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["backend"] == "reference" and r["plain_ms"] > 0
    for name in ("libra", "ulysses", "wlb"):
        s = r["systems"][name]
        assert s["operator_ms"] > 0 and s["host_copies"] == 0
        assert 1 <= s["kernel_calls_fwd"] <= 2 and s["kernel_calls_bwd"] == s["kernel_calls_fwd"]


def test_bench_planner_dp_sweep_reports_growth(capsys):
    from megatron.libra.cli import main

    assert main(["bench", "planner", "--dp", "8,16", "--steps", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [row["dp"] for row in r["rows"]] == [8, 16] and r["growth_exponent"] is not None
    for row in r["rows"]:  # the host time around the plan is reported beside it
        assert row["source_ms"] > 0 and row["convert_ms"] >= 0 and row["convert_lists_ms"] > 0
        assert "ms_one_thread" not in row
    assert main(["bench", "planner", "--dp", "12"]) == 2  # not a multiple of the pool size
    assert main(["bench", "planner", "--dp", "8", "--busy", "-1"]) == 2


def test_bench_planner_under_busy_loops_times_one_thread_beside_automatic(capsys):
    from megatron.libra.cli import main

    assert main(["bench", "planner", "--dp", "8", "--steps", "1", "--busy", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    row = r["rows"][0]
    assert r["busy"] == 1 and row["ms_one_thread"] > 0
    assert row["auto_over_one_thread"] == pytest.approx(row["ms"] / row["ms_one_thread"])


def test_bench_planner_times_a_cost_table_beside_pairs(capsys):
    from megatron.libra.cli import main

    assert main(["bench", "planner", "--dp", "8", "--steps", "1", "--cost-table", "profile",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    row = r["rows"][0]
    assert r["cost_table"] == "profile" and row["ms_table"] > 0
    assert row["table_over_pairs"] == pytest.approx(row["ms_table"] / row["ms"])
    assert set(row["phase_ms_table"]) == set(row["phase_ms"])
    assert main(["bench", "planner", "--dp", "8", "--cost-table", "no-such-file.json"]) == 2
    assert "cost table no-such-file.json: cannot open" in capsys.readouterr().err


def test_lengths_longer_than_the_context_are_said_to_be_cut(tmp_path, capsys):
    from megatron.libra.cli import main

    f = tmp_path / "lengths.txt"
    f.write_text("100\n5000\n20000\n")
    args = ["plan", "--lengths-file", str(f), "--context", "4096", "--gbs", "4", "--dp", "2",
            "--cp", "1", "--pool-size", "2", "--steps", "1", "--heads", "4", "--kv-heads", "4",
            "--json"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "2 document length(s)" in err and "exceed the context (4096)" in err


def test_config_reference_page_is_current_and_help_shows_defaults(capsys):
    from pathlib import Path

    from megatron.libra.cli import main
    from megatron.libra.config_doc import render

    page = Path(__file__).resolve().parents[2] / "docs" / "config_reference.md"
    assert page.read_text() == render(), "regenerate: python -m megatron.libra.config_doc"
    assert "| `parallel.timeout_minutes` | `10.0` |" in page.read_text()
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "(default: 16)" in out and "{megatron,contiguous}" in out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "docs/config_reference.md" in capsys.readouterr().out


@pytest.mark.parametrize(
    "module",
    ["megatron.libra.cli", "megatron.libra.cli.plan", "megatron.libra.cli.bench",
     "megatron.libra.cli.sim", "megatron.libra.cli.verify", "megatron.libra.cli.memory",
     "megatron.libra.cli.train"],
)
def test_planner_cli_starts_without_torch_or_megatron_core(module):
    import subprocess
    import sys

    code = (
        f"import sys; import {module}; "
        "bad = [m for m in ('torch', 'megatron.core') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing {module} pulled in {out.stdout.strip()}"


def test_bench_host_reports_the_sampler_lead_over_the_modeled_step(capsys):
    assert main(["bench", "host", "--steps", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r["layouts"]) == {"256k", "1m"}
    for name, row in r["layouts"].items():
        parts = row["source_ms"] + row["plan_ms"] + row["rank_host_ms"]
        assert row["host_ms"] == pytest.approx(parts)
        assert row["lead_ms"] == pytest.approx(row["gpu_step_ms"] - row["host_ms"])
        assert row["slots"] >= 1
        # compact descriptors: KiB per rank and step, compiled in milliseconds per slot
        assert 0 < row["upload_bytes"]["median"] <= row["upload_bytes"]["max"] < 1 << 20
        ms = row["host_compile_ms"]
        assert 0 < ms["median"] <= ms["max"]
        assert row["unpack_ms"] > 0  # the upload's unpacking, on the training thread
        assert "gil" not in row  # (only with --gil)


def test_bench_host_gil_measures_the_compile_beside_a_gil_free_call_of_its_length(capsys):
    assert main(["bench", "host", "--steps", "1", "--gil", "--gil-seconds", "0.3",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for name, row in r["layouts"].items():
        for key in ("gil", "gil_free", "gil_reference"):
            g = row[key]
            assert 0 <= g["blocked_fraction"] <= 1 and g["call_ms"] > 0, (name, key)
            assert g["lost_ms_per_call"] == pytest.approx(g["blocked_fraction"] * g["call_ms"])
        # the floor is sized to the compile: about as long (a doubling, noise)
        assert row["gil_free"]["call_ms"] > 0.25 * row["gil"]["call_ms"], name


@pytest.mark.parametrize("argv,message", [
    (["--nproc", "4", "a.b=1"], "key=value overrides are libra train's; give "
     "pretrain_gpt_libra.py's arguments after `--`"),
    (["--", "--lr", "1"], "--trainer megatron launches pretrain_gpt_libra.py under torchrun on "
     "this machine: give --nproc"),
    (["--nproc", "4", "--", "--train-iters", "5"], "--train-iters: libra ab sets it for every "
     "run (--systems, --steps)"),
    (["--nproc", "4", "--moe-balancers", "none,libra"], "--moe-balancers: the MoE balancer A/B "
     "runs through libra train"),
])
def test_ab_through_megatron_lm_refuses_what_it_cannot_run(capsys, argv, message):
    # refused in one line before anything is launched (the parser's own errors exit 2 too)
    try:
        code = main(["ab", "--trainer", "megatron", "--config",
                     "configs/megatron/cpu_tiny.yaml", *argv])
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_arguments_after_a_double_dash_are_only_for_megatron_lm(capsys):
    with pytest.raises(SystemExit) as e:
        main(["ab", "--config", "configs/train/cpu_tiny.yaml", "--", "--lr", "1"])
    assert e.value.code == 2
    assert "arguments after `--` are pretrain_gpt_libra.py's" in capsys.readouterr().err


def test_ab_reads_repeats_that_differ_at_rounding_apart_from_ones_that_differ():
    # deferred: only this test needs the trainer's CLI module
    from megatron.libra.cli.train import LOSS_ROUNDING, _interleaved, _same_over_repeats

    curves = {"same": [[4.0, 3.0], [4.0, 3.0]],
              "online": [[4.0, 3.0], [4.0, 3.0 * (1 + 3e-8)]],
              "apart": [[4.0, 3.0], [4.0, 3.3]],
              "nan": [[4.0, float("nan")], [4.0, 3.0]]}
    runs = {name: iter(c) for name, c in curves.items()}
    _, spread, _ = _interleaved(2, list(curves), lambda name: [
        {"loss": x, "tokens": 8, "step_time": 1.0, "attn_time_max_over_mean": 1.0}
        for x in next(runs[name])
    ])
    assert spread["same"] == 0.0 and spread["online"] == pytest.approx(3e-8, rel=1e-3)
    assert spread["apart"] == pytest.approx(0.1) and spread["nan"] == float("inf")
    cells = {name: _same_over_repeats(d) for name, d in spread.items()}
    assert cells == {"same": "yes", "online": "to 3.0e-08", "apart": "NO (1.0e-01)",
                     "nan": "NO (inf)"}
    assert 3e-8 < LOSS_ROUNDING < 0.1
