"""Pipeline parallelism, virtual stages and activation recompute in the training application on
CPU gloo: the same losses as the single-stage run (weights are seeded per global layer, so every
layout starts alike), Libra equal to Ulysses under PP, recompute equal to no recompute, and a
PP-2 checkpoint resumed at PP 1."""

import shutil

import pytest
import torch

from megatron.libra.config import TrainConfig
from megatron.libra.launch import launch

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU / gloo path"),
    pytest.mark.slow,  # spawns training processes
]
CPU_TINY = "configs/train/cpu_tiny.yaml"
# 2 replicas in one Libra pool, no CP: 2 ranks at PP 1, 4 at PP 2
BASE = ["schedule.train_steps=3", "schedule.warmup_steps=1", "parallel.cp=1"]


def _close(a: list, b: list, rel: float, key: str = "loss") -> None:
    assert len(a) == len(b) and a, (a, b)
    for x, y in zip(a, b):
        assert abs(x[key] - y[key]) <= rel * abs(y[key]), (key, [h[key] for h in a],
                                                            [h[key] for h in b])


def test_two_stages_match_one_stage_and_libra_matches_ulysses():
    pp1 = launch(TrainConfig.load(CPU_TINY, BASE), 2, 2)
    pp2 = launch(TrainConfig.load(CPU_TINY, BASE + ["parallel.pp=2"]), 4, 4)
    _close(pp2, pp1, 1e-5)
    _close(pp2, pp1, 1e-4, "grad_norm")
    uly = launch(TrainConfig.load(CPU_TINY, BASE + ["parallel.pp=2", "system.name=ulysses"]), 4, 4)
    _close(pp2, uly, 1e-4)


def test_tied_embeddings_across_the_first_and_last_stage():
    """With model.tie_embeddings the last stage's output layer starts as the first stage's
    embedding and their gradients are summed (megatron-core's embedding group): PP 2 = PP 1."""
    over = BASE + ["model.tie_embeddings=true"]
    pp1 = launch(TrainConfig.load(CPU_TINY, over), 2, 2)
    pp2 = launch(TrainConfig.load(CPU_TINY, over + ["parallel.pp=2"]), 4, 4)
    _close(pp2, pp1, 1e-5)
    _close(pp2, pp1, 1e-4, "grad_norm")
    untied = launch(TrainConfig.load(CPU_TINY, BASE), 2, 2)
    assert untied[-1]["loss"] != pp1[-1]["loss"]  # the switch changes the model


def test_interleaved_stages_match_one_stage():
    """PP 4 with 2 virtual stages each (8 layers, 4 micro-batches) against PP 1, in fp64 (every
    parameter follows dtype, the norms' weights too: DDP reduces one dtype per buffer)."""
    over = BASE + ["model.layers=8", "parallel.pool_size=1", "data.gbs=4", "dtype=fp64"]
    pp1 = launch(TrainConfig.load(CPU_TINY, over), 1, 1)
    vpp = launch(TrainConfig.load(CPU_TINY, over + ["parallel.pp=4", "parallel.vpp=2"]), 4, 4)
    _close(vpp, pp1, 1e-9)
    _close(vpp, pp1, 1e-6, "grad_norm")  # megatron-core all-reduces the norm in fp32


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_the_same_losses(mode):
    """Selective recompute runs the Libra operator (and its pool exchange) again in the backward;
    full recompute whole layers: the losses and gradients do not change (fp64)."""
    over = BASE + ["dtype=fp64"]
    plain = launch(TrainConfig.load(CPU_TINY, over), 2, 2)
    again = launch(TrainConfig.load(CPU_TINY, over + [f"model.recompute={mode}"]), 2, 2)
    _close(again, plain, 1e-6)
    _close(again, plain, 1e-6, "grad_norm")


def test_balanced_micro_batch_order_trains_the_same_samples():
    """system.pp_order=balanced reorders each pool's micro-batches: the same samples, so the same
    loss up to the order of gradient accumulation."""
    over = BASE + ["parallel.pp=2", "data.gbs=8"]
    plain = launch(TrainConfig.load(CPU_TINY, over), 4, 4)
    ordered = launch(TrainConfig.load(CPU_TINY, over + ["system.pp_order=balanced"]), 4, 4)
    _close(ordered, plain, 1e-5)
    assert [h["tokens"] for h in ordered] == [h["tokens"] for h in plain]


def test_two_stage_checkpoint_resumes_at_one_stage(tmp_path):
    ck = tmp_path / "ck"
    over = BASE[1:] + ["schedule.train_steps=4", f"checkpoint.dir={ck}"]
    over += ["checkpoint.save_interval=2"]
    full = launch(TrainConfig.load(CPU_TINY, over + ["parallel.pp=2"]), 4, 4)
    shutil.rmtree(ck / "iter_0000004")
    (ck / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = launch(TrainConfig.load(CPU_TINY, over), 2, 2)
    assert [h["step"] for h in resumed] == [3, 4]
    _close(resumed, full[2:], 1e-5)
