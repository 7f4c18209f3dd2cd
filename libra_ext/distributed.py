"""Process helpers shared by the trainers, the launchers and the multi-process tools: a free
loopback port for a gloo rendezvous, each local worker's share of the cores, a world-1 process
group for single-process runs of the operator, and local ranks started from a fork server that
has imported what they need once where no GPU is visible (`run_ranks`)."""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import time
from multiprocessing import forkserver, reduction

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


def start_method(preload: tuple[str, ...]) -> str:
    """How this process starts local ranks: "forkserver" where no GPU is visible, with
    `preload` among the modules the fork server imports before it forks anything; "spawn"
    where one is. Importing torch (and megatron-core, for the trainers' workers) costs each
    spawned process seconds of CPU; the server pays it once for as many processes and launches
    as this process starts, and forks before it runs anything, so each process starts as clean
    as a spawned one - except for CUDA: megatron-core's and torch's imports ask for a device,
    after which no forked child can initialize CUDA ("Cannot re-initialize CUDA in forked
    subprocess"), so with a GPU ranks are spawned. A server already running keeps what it
    loaded (a process started later imports the rest itself). It ends with this process
    (`end_fork_server`)."""
    if torch.cuda.is_available():
        return "spawn"
    ctx = torch.multiprocessing.get_context("forkserver")
    if fork_server_pid() is None:
        have = list(getattr(forkserver._forkserver, "_preload_modules", None) or [])
        ctx.set_forkserver_preload(have + [m for m in preload if m not in have])
    if not getattr(end_fork_server, "registered", False):
        atexit.register(end_fork_server)
        end_fork_server.registered = True
    return "forkserver"


def fork_server_pid() -> int | None:
    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def end_fork_server() -> None:
    """End this process's fork server now (at exit): SIGTERM's default action (the server sets
    none) rather than a teardown of the modules it loaded, which would outlive this process by
    a fraction of a second. The server is reaped, within a bounded wait."""
    pid = fork_server_pid()
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return
        time.sleep(0.01)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


class FromParent:
    """What a process started from the fork server takes from the process that asked for it,
    as it starts, rather than from the server, which began earlier: that process's environment
    and its stdout and stderr now (the server's are those of its first start: a since-changed
    environment, a test's output that was captured then), and any further descriptors named in
    `fds` (as an int each: the parent's; as a DupFd in the child until `apply`). The
    descriptors travel with the process's arguments (`DupFd`)."""

    def __init__(self, fds: tuple = (), env: dict[str, str] | None = None, stdio: tuple = ()):
        self.fds, self.env, self.stdio = fds, env, stdio

    def __reduce__(self):  # pickled in the parent, for the fork server to hand over
        dup = tuple(reduction.DupFd(fd) if _is_open(fd) else None for fd in (*self.fds, 1, 2))
        return (type(self), (dup[:-2], dict(os.environ), dup[-2:]))

    def apply(self) -> list[int | None]:
        """In the child: take the parent's environment, stdout and stderr; returns the further
        descriptors, as this process's."""
        for target, fd in zip((sys.stdout, sys.stderr), self.stdio):
            if fd is not None:
                target.flush()
                new = fd.detach()
                if new != target.fileno():  # (spawned: the parent's descriptor, inherited)
                    os.dup2(new, target.fileno())
                    os.close(new)
        if self.env is not None:
            os.environ.clear()
            os.environ.update(self.env)
        return [None if fd is None else fd.detach() for fd in self.fds]


def _rank(rank: int, fn, parent: FromParent, *args) -> None:
    parent.apply()
    fn(rank, *args)


def run_ranks(fn, args: tuple, nprocs: int, preload: tuple[str, ...] = ()) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)` (join, and a failed rank's error raised
    here), each rank forked from the fork server that has imported `preload` and `fn`'s module
    where no GPU is visible (`start_method`); each takes this process's environment and output
    as it starts (`FromParent`)."""
    method = start_method((*preload, *([fn.__module__] if fn.__module__ != "__main__" else [])))
    torch.multiprocessing.start_processes(_rank, args=(fn, FromParent(), *args), nprocs=nprocs,
                                          join=True, start_method=method)
