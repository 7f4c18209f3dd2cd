"""megatron-core end to end on CPU gloo: a GPTModel whose core attention is Libra's operator
trains with megatron-core's DDP, optimizer and forward-backward schedule (the Trainer that
`libra train` runs), and placing the step's sequences with Libra (VRSP + moved tiles) gives the
same losses as Ulysses' production order."""

import pytest
import torch

from megatron.libra.config import TrainConfig
from megatron.libra.launch import launch

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU / gloo path"),
    pytest.mark.slow,  # spawns training processes
]

# 2 replicas in one pool, no CP, two 128-token sequences per replica and step, short blocks so
# that Libra cuts and moves tiles
OVER = ["parallel.cp=1", "parallel.pool_size=2", "system.block=16", "schedule.train_steps=3",
        "schedule.warmup_steps=1", "dtype=fp64"]


def test_libra_and_ulysses_train_to_the_same_losses():
    uly = launch(TrainConfig.load("configs/train/cpu_tiny.yaml", OVER + ["system.name=ulysses"]),
                 2, 2)
    lib = launch(TrainConfig.load("configs/train/cpu_tiny.yaml", OVER), 2, 2)
    assert sum(h["bytes_exchanged"] for h in lib) > 0  # libra really moved tiles
    assert sum(h["bytes_exchanged"] for h in uly) == 0
    for a, b in zip(uly, lib):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (uly, lib)
    assert lib[-1]["loss"] < lib[0]["loss"]
