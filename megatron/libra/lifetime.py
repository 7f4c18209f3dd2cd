"""Nothing a run starts outlives it, however it ends.

A run's processes: the workers (spawned by `libra train`'s launcher, or by torchrun), and what
they start - megatron-core's checkpoint writers and their result queue's manager process, each
a `multiprocessing` process (and the resource trackers those keep alive). A worker killed with
SIGKILL, or a launcher killed so, leaves its children running: nothing tells them (they are
reparented to init, or to a subreaper).

`end_children_with_this_process()` makes every `multiprocessing` process this process starts
from then on (fork, spawn or forkserver) watch its parent (`watch_parent`) before it runs its
target, so it ends within a fraction of a second of the parent's death. A worker started by
torchrun watches its launcher the same way (`watch_torchrun`). A process started from a shell
does not watch its parent: a run under nohup must outlive its terminal.
"""

from __future__ import annotations

import os
import sys
import threading
from multiprocessing.process import BaseProcess

POLL_S = 0.5
"""Seconds between two looks at the parent."""

_PATCHED = "_libra_watched"


def _end_now(why: str) -> None:
    """Exit status 1, no cleanup (whoever would wait for this process is gone), saying why."""
    try:
        sys.stderr.write(f"[pid {os.getpid()}] {why}: ending\n")
        sys.stderr.flush()
    finally:
        os._exit(1)


def watch_parent(poll_s: float = POLL_S) -> None:
    """End this process (exit status 1, no cleanup: its parent, which would wait for it, is
    gone) as soon as its parent has: a daemon thread notices that the process was reparented."""
    parent = os.getppid()
    if parent <= 1:  # already an orphan: nothing to watch
        return

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(poll_s):
            if os.getppid() != parent:
                _end_now(f"its parent ({parent}) is gone")

    threading.Thread(target=watch, name="libra-parent-watch", daemon=True).start()


def end_with_pipe(fd: int | None) -> None:
    """End this process (as `watch_parent` does) once every write end of the pipe whose read end
    is `fd` has closed: a launcher that is not this process's parent holds one (`launch`)."""
    if fd is None:
        return

    def watch() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        _end_now("its launcher is gone")

    threading.Thread(target=watch, name="libra-launcher-watch", daemon=True).start()


class _Watched:
    """A process target that first watches the parent (picklable for spawn: the target is)."""

    def __init__(self, target):
        self.target = target

    def __call__(self, *args, **kwargs):
        watch_parent()
        return self.target(*args, **kwargs)


def end_children_with_this_process() -> None:
    """From now on every multiprocessing process this one starts ends when this one does
    (idempotent)."""
    if getattr(BaseProcess.start, _PATCHED, False):
        return
    original = BaseProcess.start

    def start(self):
        if self._target is not None and not isinstance(self._target, _Watched):
            self._target = _Watched(self._target)
        return original(self)

    setattr(start, _PATCHED, True)
    BaseProcess.start = start


def watch_torchrun() -> None:
    """A worker started by torchrun (TORCHELASTIC_RUN_ID set) ends when its launcher does."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        watch_parent()
