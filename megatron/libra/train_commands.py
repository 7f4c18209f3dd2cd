"""`libra train` and `libra ab`."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from megatron.libra.config import TrainConfig


def add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="pretrain on megatron-core with Libra or a baseline",
        description="Train with the YAML config; `key.sub=value` overrides. "
        "torchrun / Slurm set the ranks; on a CPU machine --nproc N launches N gloo "
        "workers itself.",
    )
    p.add_argument("--config", required=True, help="training config YAML")
    p.add_argument("--nproc", type=int, help="launch this many local worker processes")
    p.add_argument("overrides", nargs="*", help="key.sub=value")
    p.set_defaults(func=run_train)


def _world(args) -> int:
    if args.nproc is not None:
        if args.nproc <= 0:
            raise ValueError(f"nproc must be positive, got {args.nproc}")
        return args.nproc
    return int(os.environ.get("WORLD_SIZE", 1))


def _worker(rank: int, world: int, port: int, cfg: TrainConfig, out: str | None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from megatron.libra.train import run

    history = run(cfg, rank, world, f"tcp://127.0.0.1:{port}")
    if out and rank == 0:
        Path(out).write_text(json.dumps(history))


def launch(cfg: TrainConfig, world: int, nproc: int | None, out: str | None = None) -> list[dict]:
    """Run training with `world` ranks: spawned locally when nproc is given, else in this process
    (torchrun / Slurm / single process)."""
    if nproc is not None:
        import tempfile

        import torch.multiprocessing as mp

        from libra_ext.attention.verify import free_port

        with tempfile.TemporaryDirectory() as tmp:
            target = out or os.path.join(tmp, "history.json")
            mp.spawn(_worker, args=(world, free_port(), cfg, target), nprocs=nproc, join=True)
            return json.loads(Path(target).read_text())
    from megatron.libra.train import run

    return run(cfg)


def run_train(args):
    cfg = TrainConfig.load(args.config, args.overrides)
    world = _world(args)
    cfg.validate(world)  # before any process group exists
    logging.getLogger("libra.train").setLevel(logging.WARNING)
    launch(cfg, world, args.nproc)
    return None
