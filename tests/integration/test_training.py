"""The training application end to end on CPU gloo: A/B runs where placement does not change
the loss, the loss falls, and a resumed run repeats an uninterrupted one."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron.libra.checkpoint import latest_step
from megatron.libra.cli import main
from megatron.libra.config import TrainConfig
from megatron.libra.launch import launch

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU / gloo path"),
    pytest.mark.slow,  # spawns training or multi-rank processes
]
CPU_TINY = "configs/train/cpu_tiny.yaml"


def test_ab_libra_matches_ulysses_and_learns(tmp_path, capsys):
    out = tmp_path / "ab"
    assert (
        main(
            [
                "ab",
                "--config",
                CPU_TINY,
                "--systems",
                "libra,ulysses",
                "--steps",
                "8",
                "--repeats",
                "2",
                "--nproc",
                "4",
                "--out",
                str(out),
                "--json",
                "schedule.warmup_steps=2",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    r = json.loads(captured.out)
    # interleaved: libra, ulysses, libra, ulysses
    order = [ln.split(":")[1].split(",")[0].strip() for ln in captured.err.splitlines()
             if ln.startswith("[ab ")]
    assert order == ["libra", "ulysses", "libra", "ulysses"], captured.err[-2000:]
    assert r["repeats"] == 2 and r["overrides"] == ["schedule.warmup_steps=2"]
    assert r["speed_meaningful"] is False
    lib, uly = r["systems"]["libra"], r["systems"]["ulysses"]
    for s in (lib, uly):
        assert s["losses_identical_over_repeats"]  # deterministic: repeats differ in time only
        spread = s["repeats"]["tokens_per_s"]
        assert len(spread["runs"]) == 2 and spread["min"] <= spread["median"] <= spread["max"]
        # each rank's own kernel time (no collective waits), per run the mean over its steps
        kernel = s["repeats"]["attn_kernel_time_max_over_mean"]
        runs = s["attn_kernel_time_max_over_mean"]
        assert len(kernel["runs"]) == 2 and all(x >= 1.0 for x in kernel["runs"])
        assert kernel["runs"][0] == pytest.approx(sum(runs) / len(runs))
    ratio = lib["tokens_per_s_ratio_vs_ulysses"]
    assert len(ratio["runs"]) == 2 and uly["tokens_per_s_ratio_vs_ulysses"]["median"] == 1.0
    report = (out / "report.md").read_text()
    assert "`schedule.warmup_steps=2`" in report and "not meaningful" in report
    assert "median (range)" in report and "attn kernel time max/mean" in report
    for key in ("loss", "attn_work_max_over_mean", "attn_time_max_over_mean"):
        assert len(lib[key]) == 8 and len(uly[key]) == 8
    assert lib["max_rel_loss_diff_vs_ulysses"] <= 1e-4
    assert lib["loss"][-1] < lib["loss"][0] - 0.3  # it learns
    assert lib["tokens_per_s"] > 0 and sum(lib["bytes_exchanged"]) > 0
    for f in ("report.md", "ab.json", "loss.png", "attention_time.png", "tokens_per_s.png"):
        assert (out / f).stat().st_size > 0


def test_killed_run_resumes_like_the_uninterrupted_run(tmp_path):
    """SIGKILL a training run once its step-3 checkpoint is complete, resume it from megatron-core's
    distributed checkpoint: steps 4-6 repeat the uninterrupted run. The killed run saves in the
    background (async save): the tracker must not name a step before its shards are written."""
    over = [
        "schedule.train_steps=6",
        "schedule.warmup_steps=1",
        "checkpoint.save_interval=3",
        "parallel.cp=1",
        "parallel.pool_size=2",
    ]
    full = launch(TrainConfig.load(CPU_TINY, over + [f"checkpoint.dir={tmp_path / 'full'}"]), 2, 2)
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-c", "from megatron.libra.cli import main; raise SystemExit(main())"]
    cmd += ["train", "--config", CPU_TINY, "--nproc", "2", *over, f"checkpoint.dir={ck}"]
    cmd += ["checkpoint.async_save=true"]
    proc = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.DEVNULL)
    tracker = ck / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 300
    try:
        while not (tracker.is_file() and tracker.read_text() == "3"):
            assert proc.poll() is None, "the run ended before its step-3 checkpoint"
            assert time.monotonic() < deadline, "no step-3 checkpoint after 300 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert tracker.read_text() == "3", "killed too late: the run got to its last checkpoint"
    assert (ck / "iter_0000003" / "metadata.json").is_file()  # megatron-core dist checkpoint
    resumed = launch(
        TrainConfig.load(CPU_TINY, over + [f"checkpoint.dir={ck}", "checkpoint.async_save=true"]),
        2,
        2,
    )
    assert [h["step"] for h in resumed] == [4, 5, 6]
    for a, b in zip(full[3:], resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (full, resumed)
    assert latest_step(ck) == 6  # the last background save finished before the run ended


def test_moe_with_expert_parallelism_trains_checkpoints_and_matches_ulysses(tmp_path):
    """Qwen3-style MoE (top-2 of 4 experts, QK-norm, rope base 1e6) with the experts split over
    2 ranks: Libra's losses equal Ulysses's, and the expert-sharded dist checkpoint resumes."""
    moe = [
        "model.moe_topk=2",
        "model.experts=4",
        "model.moe_ffn=64",
        "model.qk_norm=true",
        "model.rope_base=1000000",
        "parallel.ep=2",
        "schedule.train_steps=4",
        "schedule.warmup_steps=1",
    ]
    ck = tmp_path / "ck"
    save = [f"checkpoint.dir={ck}", "checkpoint.save_interval=2"]
    lib = launch(TrainConfig.load(CPU_TINY, moe + save), 4, 4)
    uly = launch(TrainConfig.load(CPU_TINY, moe + ["system.name=ulysses"]), 4, 4)
    for a, b in zip(lib, uly):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), (lib, uly)
    assert all(h["loss"] == h["loss"] and h["grad_norm"] > 0 for h in lib)
    shutil.rmtree(ck / "iter_0000004")
    (ck / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = launch(TrainConfig.load(CPU_TINY, moe + save), 4, 4)
    assert [h["step"] for h in resumed] == [3, 4]
    for a, b in zip(lib[2:], resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (lib, resumed)


def test_checkpoint_resumes_under_another_context_parallel_layout(tmp_path):
    """Saved on 4 ranks (CP 2), resumed on 2 ranks (CP 1): the sharded checkpoint loads into the
    other layout and the run continues as the uninterrupted one (the gradient is that of the
    global per-token loss whatever the CP size, so gradient norms and clipping agree too)."""
    ck = tmp_path / "ck"
    over = [
        "schedule.train_steps=6",
        "schedule.warmup_steps=1",
        f"checkpoint.dir={ck}",
        "checkpoint.save_interval=3",
    ]
    full = launch(TrainConfig.load(CPU_TINY, over), 4, 4)
    shutil.rmtree(ck / "iter_0000006")
    (ck / "latest_checkpointed_iteration.txt").write_text("3")
    resumed = launch(TrainConfig.load(CPU_TINY, over + ["parallel.cp=1"]), 2, 2)
    assert [h["step"] for h in resumed] == [4, 5, 6]
    for a, b in zip(full[3:], resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (full, resumed)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (full, resumed)


def test_checkpoint_of_another_model_is_refused_before_workers_start(tmp_path, capsys):
    ck = tmp_path / "ck"
    over = ["schedule.train_steps=1", "schedule.warmup_steps=0", "parallel.cp=1"]
    launch(TrainConfig.load(CPU_TINY, over + [f"checkpoint.dir={ck}"]), 2, 2)
    capsys.readouterr()
    args = ["train", "--config", CPU_TINY, "--nproc", "2", *over, f"checkpoint.dir={ck}"]
    assert main(args + ["model.layers=3", "schedule.train_steps=2"]) == 2
    err = capsys.readouterr().err
    assert "holds another model: model.layers = 2 there, 3 here" in err, err


def test_tensor_parallel_run_matches_the_single_rank_layout():
    """TP 2 (4 ranks) against TP 1 (2 ranks), same replicas: the same losses and gradients."""
    over = ["schedule.train_steps=3", "schedule.warmup_steps=1", "parallel.cp=1"]
    tp2 = launch(TrainConfig.load(CPU_TINY, over + ["parallel.tp=2"]), 4, 4)
    tp1 = launch(TrainConfig.load(CPU_TINY, over), 2, 2)
    for a, b in zip(tp2, tp1):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (tp2, tp1)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], (tp2, tp1)


WANDB_STANDIN = """
import json, os
_log = os.environ["WANDB_STANDIN_LOG"]
class _Run:
    def log(self, data, step=None):
        with open(_log, "a") as f:
            f.write(json.dumps({"step": step, **data}) + "\\n")
    def finish(self):
        pass
def init(project=None, name=None, config=None):
    with open(_log, "a") as f:
        f.write(json.dumps({"init": project, "config": sorted(config or {})}) + "\\n")
    return _Run()
"""
"""A stand-in for the wandb package (not installed here): it writes what it is given."""


def test_torchrun_launch_trains_like_the_local_launcher(tmp_path):
    """The path Slurm uses (torchrun, env:// rendezvous) gives the same losses as --nproc; its
    figures reach TensorBoard and Weights & Biases (a stand-in of wandb), validation included."""
    over = ["schedule.train_steps=2", "schedule.warmup_steps=1", "parallel.cp=1"]
    local = launch(TrainConfig.load(CPU_TINY, over), 2, 2)
    metrics, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "wandb.py").write_text(WANDB_STANDIN)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "megatron.libra.cli", "train", "--config", CPU_TINY, *over]
    cmd += [f"logging.metrics_file={metrics}", "logging.log_interval=1",
            f"logging.tensorboard_dir={tb}", "logging.wandb_project=libra-test",
            "schedule.eval_interval=2", "schedule.eval_iters=1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_STANDIN_LOG=str(tmp_path / "wandb.jsonl"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), *sys.path]))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "iteration        2/       2" in out.stdout
    runs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in runs] == [1, 2]
    for a, b in zip(local, runs):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (local, runs)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("loss", "tokens_per_s", "attn_work_max_over_mean", "attn_time_max_over_mean",
                "inter_pool_imbalance", "pool_mb_per_rank", "cp_mb_per_rank", "plan_ms",
                "lm loss validation"):
        assert tag in tags, (tag, sorted(tags))
    assert [e.step for e in acc.Scalars("loss")] == [1, 2]
    logged = [json.loads(x) for x in (tmp_path / "wandb.jsonl").read_text().splitlines()]
    assert logged[0]["init"] == "libra-test" and "system" in logged[0]["config"]
    assert [x["step"] for x in logged[1:] if "loss" in x] == [1, 2]
    assert any("lm loss validation" in x for x in logged)


def test_moe_expert_balancer_keeps_the_math_and_evens_expert_load(tmp_path, capsys):
    """moe.balancer=libra on EP 2 (gloo): the same losses and gradient norms as megatron-core's
    layer, lower expert-token max/mean per EP rank, and a routing record `libra bench moe`
    reads; without the lookahead too."""
    moe = [
        "model.moe_topk=2", "model.experts=16", "model.moe_ffn=32", "model.layers=3",
        "parallel.ep=2", "parallel.cp=1", "parallel.pool_size=2", "data.gbs=4",
        "transformer_impl=local", "schedule.train_steps=4", "schedule.warmup_steps=1",
        "moe.replica_slots=2",
    ]
    base = launch(TrainConfig.load(CPU_TINY, moe), 2, 2)
    rec = tmp_path / "routing"
    bal = launch(TrainConfig.load(CPU_TINY, moe + [
        "moe.balancer=libra", "logging.record_routing=true", f"logging.routing_dir={rec}"]), 2, 2)
    exact = launch(TrainConfig.load(CPU_TINY, moe + ["moe.balancer=libra",
                                                     "moe.lookahead=false"]), 2, 2)
    for a, b, c in zip(base, bal, exact):
        for x in (b, c):
            assert abs(a["loss"] - x["loss"]) <= 1e-5 * abs(a["loss"]), (base, bal)
            assert abs(a["grad_norm"] - x["grad_norm"]) <= 1e-5 * a["grad_norm"], (base, bal)
    before = sum(h["expert_tokens_max_over_mean_before"] for h in bal) / len(bal)
    after = sum(h["expert_tokens_max_over_mean_after"] for h in bal) / len(bal)
    assert after < before, bal
    assert all(0.5 < h["lookahead_topk_overlap"] <= 1.0 for h in bal)
    assert all(0.0 <= h["lookahead_load_error"] < 1.0 for h in bal)
    assert all("lookahead_topk_overlap" not in h for h in exact)
    assert sorted(int(k) for k in bal[0]["moe_layers"]["expert_tokens_max_over_mean_after"]) == [
        1, 2, 3]
    files = sorted(rec.glob("routing_step*.npz"))
    assert len(files) == 4
    capsys.readouterr()
    assert main(["bench", "moe", "--routing", str(files[-1]), "--experts", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ep"] == 2 and out["layers"] == 3
    assert out["max_over_mean_after_exact"] <= out["max_over_mean_before"]
    # the same A/B through `libra ab --moe-balancers`
    assert main(["ab", "--config", CPU_TINY, "--moe-balancers", "none,libra", "--steps", "2",
                 "--repeats", "1", "--nproc", "2", "--out", str(tmp_path / "ab"), "--json"]
                + moe) == 0
    ab = json.loads(capsys.readouterr().out)
    lib = ab["systems"]["moe.balancer=libra"]
    assert ab["reference"] == "moe.balancer=none"
    assert lib["max_rel_loss_diff_vs_moe.balancer=none"] <= 1e-5
    assert lib["max_rel_grad_norm_diff_vs_moe.balancer=none"] <= 1e-5
    assert len(lib["expert_tokens_max_over_mean_after"]) == 2


def _moe_rows_worker(rank, world, port, out, overrides):
    from megatron.libra import moe_layer
    from megatron.libra.train import Trainer

    cfg = TrainConfig.load(CPU_TINY, overrides)
    trainer = Trainer(cfg, rank, world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        batch = trainer.sampler.next()
        results = []
        for per_layer in (False, True):
            micro = trainer.micro_batches(batch)  # sets the step's rows
            assert moe_layer.step_rows() is not None
            if per_layer:  # a drop-in layer without the training loop: counts per layer
                moe_layer.set_step_rows(None)
            outs = trainer.forward_backward(micro, float(batch.label_tokens))  # zeroes grads
            loss = sum(float(o["local_sum"]) for o in outs)
            grads = torch.cat([p.main_grad.reshape(-1) for c in trainer.chunks
                               for p in c.parameters() if p.requires_grad])
            results.append((loss, grads.clone()))
            disp = [m.token_dispatcher for c in trainer.chunks for m in c.modules()
                    if isinstance(getattr(m, "token_dispatcher", None),
                                  moe_layer.PaddedAllGatherDispatcher)]
            assert len(disp) == 2 and all((d.sizes is not None) == per_layer for d in disp)
        (a, ga), (b, gb) = results
        assert a > 0 and float(ga.abs().sum()) > 0
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (a, b)
        assert torch.allclose(ga, gb, rtol=1e-5, atol=1e-7), float((ga - gb).abs().max())
        if rank == 0:
            open(out, "w").write("ok")
    finally:
        trainer.sampler.close()


@pytest.mark.parametrize("balancer", ["none", "libra"])
def test_moe_all_gather_padded_to_the_step_equals_counting_per_layer(tmp_path, balancer):
    """The training loop pads every EP rank's tokens to the step's longest micro-batch (from the
    plan: no layer exchanges or reads token counts); a layer used without it all-gathers the
    counts. Same loss and gradients either way, megatron-core's layer and the balanced one."""
    from libra_ext.distributed import free_port, run_ranks

    overrides = [
        "model.moe_topk=2", "model.experts=8", "model.moe_ffn=32", "model.layers=2",
        "parallel.ep=2", "parallel.cp=1", "parallel.pool_size=2", "data.gbs=4",
        "transformer_impl=local", f"moe.balancer={balancer}", "system.name=wlb",
    ]
    out = tmp_path / "ok"
    run_ranks(_moe_rows_worker, (2, free_port(), str(out), overrides), 2)
    assert out.read_text() == "ok"
