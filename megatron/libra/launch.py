"""The local launcher of `libra train --nproc N` (and of the tests and `libra ab`): it starts N
gloo worker processes, each running `train.run` - forked from a fork server that has imported
torch, megatron-core and the training loop once for every worker and launch of the process
(about 7 s of CPU a worker saves), spawned where a GPU is visible - and makes sure that nothing
a run starts - workers, megatron-core's checkpoint writers, their resource trackers - outlives
it: SIGINT or SIGTERM ends every worker (SIGTERM, then SIGKILL after a grace period), orphans
of a dead worker reparent to the launcher (a child subreaper) so they can be found and ended,
and every process started watches its parent (`lifetime`) and a worker its launcher: a
launcher or worker killed with SIGKILL takes what it started with it.

Under torchrun or Slurm the ranks come from the environment and `launch` trains in this
process instead."""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import signal
import sys
import tempfile
import time
from multiprocessing import resource_tracker
from pathlib import Path

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from libra_ext.distributed import (FromParent, fork_server_pid, free_port, share_cores,
                                   start_method)
from megatron.libra import lifetime
from megatron.libra.config import TrainConfig
from megatron.libra.logs import LAUNCH_ENV, progress_stream
from megatron.libra.notices import quiet_megatron_notices


WORKER_IMPORTS = "megatron.libra.worker_imports"
"""What the launcher's fork server imports once, before it forks any worker: torch,
megatron-core and the training loop (`libra_ext.distributed.start_method`; with a GPU the
workers are spawned)."""


class _FromLauncher(FromParent):
    """The launcher's environment, stdout and stderr (`FromParent`), and the read end of a pipe
    only the launcher writes to, which tells the worker that its launcher has gone: the worker's
    parent is the fork server, which outlives the launcher for as long as a worker does."""

    def apply(self) -> list[int | None]:
        alive = super().apply()
        lifetime.end_with_pipe(alive[0])
        return alive


def _worker(rank: int, world: int, port: int, cfg: TrainConfig, out: str | None,
            launcher: FromParent) -> None:
    launcher.apply()
    lifetime.end_children_with_this_process()  # checkpoint writers end with this worker
    # the launcher's --log-level reaches its workers
    level = os.environ.get("LIBRA_LOG_LEVEL", "WARNING")
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    quiet_megatron_notices()  # before megatron-core is imported
    share_cores(world)
    # deferred: megatron-core, once its notices are quiet (in the worker)
    from megatron.libra.train import run

    try:
        history = run(cfg, rank, world, f"tcp://127.0.0.1:{port}")
    except (Exception, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # e.g. torch's CheckpointException: reported as a failure
        raise RuntimeError(_first_line(e)) from e
    if out and rank == 0:
        Path(out).write_text(json.dumps(history))
    end_quickly()


def end_quickly() -> None:
    """The process ends now: leave its objects to the operating system. Python's final garbage
    collection over the ~400,000 objects torch and megatron-core hold took 3 s per worker on a
    2-core host, between the run's last line and the launcher's return."""
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()


STOP_GRACE_S = 10.0
"""Seconds workers get to end after SIGTERM before they are killed."""
SAVE_GRACE_S = 600.0
"""The same with checkpoint.save_on_signal: time to finish the iteration and save."""


_PLAIN_ERRORS = ("ValueError", "megatron.libra.checkpoint.CheckpointError")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _become_subreaper() -> None:
    """Orphans of our workers (megatron-core's async checkpoint writers, when a worker dies)
    reparent to this process instead of init, so they can be found and ended (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _process_tree() -> dict[int, list[int]]:
    """parent pid -> child pids, from /proc (empty where there is none)."""
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(d.name))
    return parents


def _below(roots, tree: dict[int, list[int]]) -> list[int]:
    out, todo = [], list(roots)
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _ours(before: set[int], workers: list[int]) -> list[int]:
    """What the run started and is still alive: the workers (children of the fork server, or
    of this process where spawned), everything below them, and orphans reparented to this
    process since the run began (not the multiprocessing resource tracker, nor the fork server,
    which serves the next launch)."""
    keep = {getattr(resource_tracker._resource_tracker, "_pid", None), fork_server_pid()}
    tree = _process_tree()
    alive = {p for children in tree.values() for p in children}
    new = [p for p in tree.get(os.getpid(), []) if p not in before and p not in keep]
    roots = set(new) | {w for w in workers if w in alive}
    return sorted(roots | set(_below(roots, tree)))


def _end(before: set[int], workers: list[int], grace_s: float) -> None:
    """SIGTERM what the run started (see `_ours`), with SIGCONT so that a stopped process acts
    on it; SIGKILL what is left after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        pids = _ours(before, workers)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
                if sig == signal.SIGTERM:  # a stopped worker (SIGSTOP, a debugger) acts on it
                    os.kill(pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            for pid in pids:  # reap our exited children so they do not stay zombies
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
            if not set(_ours(before, workers)) & set(pids):
                return
            time.sleep(0.1)


def _run_workers(mp, args: tuple, nproc: int, grace_s: float = STOP_GRACE_S) -> None:
    """Start the workers (forked from the fork server, `WORKER_IMPORTS`, where no GPU is
    visible) and wait for them. SIGINT or SIGTERM to this process ends every worker (SIGTERM,
    then SIGKILL after STOP_GRACE_S) and exits 130 or 143; on every way out, nothing the run
    started (workers, checkpoint writers) outlives it."""
    _become_subreaper()
    lifetime.end_children_with_this_process()  # the workers end with this launcher
    # torch's "Terminating process N via signal SIGTERM" per worker once one failed: the line
    # below says which worker failed and why
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    stop: dict = {}

    def on_signal(signum, _frame):
        stop.setdefault("signal", signum)

    before = set(_process_tree().get(os.getpid(), []))
    workers: list[int] = []
    alive_w = None
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        method = start_method((WORKER_IMPORTS,))
        alive_r, alive_w = os.pipe()  # (closed on every way out: the workers end with it)
        try:
            ctx = mp.start_processes(_worker, args=(*args, _FromLauncher((alive_r,))),
                                     nprocs=nproc, join=False, start_method=method)
        finally:
            os.close(alive_r)
        workers = [p.pid for p in ctx.processes]
        while not ctx.join(timeout=0.5):
            if "signal" in stop:
                if grace_s > STOP_GRACE_S:  # the workers save, then end on their own
                    for p in ctx.processes:
                        if p.is_alive():
                            os.kill(p.pid, signal.SIGTERM)
                    deadline = time.monotonic() + grace_s
                    while any(p.is_alive() for p in ctx.processes):
                        if time.monotonic() > deadline:
                            break
                        time.sleep(0.2)
                break
    except ProcessException as e:  # a worker failed: its own last error line, not a dump
        text = str(e).strip().splitlines()
        last = next((t.strip() for t in reversed(text) if t.strip()), type(e).__name__)
        for name in _PLAIN_ERRORS:  # errors written for the user read without their type
            if last.startswith(name + ": "):
                last = last[len(name) + 2:]
        print(f"libra train: worker {e.error_index} failed: {last}", file=sys.stderr)
        failed = e
    else:
        failed = None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _end(before, workers, STOP_GRACE_S)
        if alive_w is not None:  # (after _end: a worker it ended is not told its launcher went)
            os.close(alive_w)
    if "signal" in stop:
        name = signal.Signals(stop["signal"]).name
        print(f"libra train: stopped by {name}: every worker ended", file=sys.stderr)
        raise SystemExit(128 + stop["signal"])
    if failed is not None:
        raise failed


def launch(cfg: TrainConfig, world: int, nproc: int | None, out: str | None = None) -> list[dict]:
    """Run training with `world` ranks: spawned locally when nproc is given, else in this process
    (torchrun / Slurm / single process)."""
    if nproc is not None:

        os.environ[LAUNCH_ENV] = str(time.time())  # the workers say how long start-up took
        port = free_port()
        print(f"libra train: starting {nproc} local worker process(es) (gloo rendezvous on "
              f"127.0.0.1:{port}) ...", file=progress_stream(), flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            target = out or os.path.join(tmp, "history.json")
            grace = SAVE_GRACE_S if cfg.checkpoint.save_on_signal else STOP_GRACE_S
            _run_workers(mp, (world, port, cfg, target), nproc, grace)
            return json.loads(Path(target).read_text())
    # deferred: megatron-core, once its notices are quiet (in the worker)
    from megatron.libra.train import run

    lifetime.watch_torchrun()  # a torchrun worker ends with its launcher
    lifetime.end_children_with_this_process()
    return run(cfg)
