"""Process helpers shared by the trainers, the launchers and the multi-process tools: a free
loopback port for a gloo rendezvous, each local worker's share of the cores, and a world-1
process group for single-process runs of the operator."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def share_cores(local_workers: int) -> int:
    """Give this worker process its share of the machine's cores as torch intra-op threads.
    Local workers that each keep a full OpenMP pool oversubscribe the cores; their spinning
    threads then starve each other's collectives (10x slower steps on 2 cores, 4 workers)."""
    n = max(1, (os.cpu_count() or 1) // max(1, local_workers))
    torch.set_num_threads(n)
    return n


def ensure_single_process_group() -> None:
    """A world-1 gloo group (the runtime's groups need one; nothing is communicated)."""
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
