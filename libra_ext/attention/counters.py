"""Counters of the attention runtime that tests and `libra verify attention` read.

Per core-attention call (one layer, one micro-batch): attention kernel calls in the forward and
in the backward, plan tiles executed, and - when `count_host` is on - host-to-device copies and
device-to-host reads made inside the operator's forward and backward. A host copy is a tensor
made from host data (torch.tensor / as_tensor / asarray / from_numpy) or a copy from a CPU
tensor to another device; on a GPU each is a transfer and usually a sync. A host read is
`.item()`, `.tolist()`, `.numpy()` or `.cpu()`. Counting uses a TorchFunctionMode (and a
wrapper of torch.from_numpy, which the mode does not see) only while switched on, so the same
count works on CPU in CI and on a GPU.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from libra_ext import hostmem

_FROM_HOST = {"tensor", "as_tensor", "asarray", "from_numpy"}
_TO_HOST = {"item", "tolist", "numpy", "cpu"}
_COPIES = {"to", "copy_", "cuda"}


def _device_of(args, kwargs):
    for a in list(args[1:]) + list(kwargs.values()):
        if isinstance(a, torch.device):
            return a
        if isinstance(a, str):
            try:
                return torch.device(a)
            except RuntimeError:
                continue
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class _HostCopyMode(TorchFunctionMode):
    def __init__(self, counts: "CallCounts"):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _FROM_HOST:
            self.counts.host_copies += 1
        elif name in _TO_HOST:
            self.counts.host_reads += 1
        elif name in _COPIES and args and isinstance(args[0], torch.Tensor):
            src = args[0]
            if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
                if args[1].device.type == "cpu" and src.device.type != "cpu":
                    self.counts.host_copies += 1
            elif src.device.type == "cpu":
                dev = torch.device("cuda") if name == "cuda" else _device_of(args, kwargs)
                if dev is not None and dev.type != "cpu":
                    self.counts.host_copies += 1
        return func(*args, **kwargs)


_KERNEL = threading.local()


@contextlib.contextmanager
def inside_kernel():
    """Mark the block as an attention kernel's own work: a traffic probe
    (`libra_ext.measure.traffic`) leaves its ops out of the operator's and its transient
    workspace out of the peak (the reference kernel enters it; the fused kernels are one op)."""
    depth = getattr(_KERNEL, "depth", 0)
    _KERNEL.depth = depth + 1
    try:
        yield
    finally:
        _KERNEL.depth = depth
        hook = getattr(_KERNEL, "on_exit", None)
        if hook is not None and depth == 0:
            hook()


def in_kernel() -> bool:
    """Inside an attention kernel's own work, on this thread."""
    return getattr(_KERNEL, "depth", 0) > 0


def on_kernel_exit(hook) -> None:
    """Call `hook()` when this thread leaves a kernel (None: no hook)."""
    _KERNEL.on_exit = hook


_RESIZE_HOOK: list = [None]
"""The probe that hears of storage resizes, process-wide: the operator frees storage in its
forward and grows it back in its backward, which autograd runs on a thread of its own for a
device (a thread-local hook missed every regrowth there)."""


def resize_storage(x: torch.Tensor, nbytes: int) -> int:
    """Resize x's storage to `nbytes` (0 frees its memory while the tensor, and every tensor
    sharing the storage, stays; the values are gone); the traffic probe listening
    (`on_storage_resize`) hears of it, on whichever thread. Returns the size before."""
    st = x.untyped_storage()
    before = st.nbytes()
    st.resize_(nbytes)
    hook = _RESIZE_HOOK[0]
    if hook is not None:
        hook(st, before, nbytes)
    return before


def on_storage_resize(hook) -> None:
    """Call `hook(storage, bytes_before, bytes_after)` when the operator resizes a storage
    (`resize_storage`, on any thread: autograd's device threads included; None: no hook)."""
    _RESIZE_HOOK[0] = hook


def cpu_clock():
    """The clock a CPU kernel is timed by: with one intra-op thread, the calling thread's CPU
    time (the kernel runs on it, forward and backward alike, so ranks that share the cores are
    not charged for each other's work); with a thread pool, wall time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


@contextlib.contextmanager
def timed_as_a_rank(device: torch.device, threads: int = 1):
    """Kernel timings on the CPU as a training rank takes them: `threads` intra-op threads (a
    rank's share where local workers share the cores; with one, `cpu_clock` is the thread's CPU
    time) and freed host memory kept in the process (no page faults inside timed calls); the
    caller's thread count restored after. Nothing on other devices."""
    if device.type != "cpu":
        yield
        return
    hostmem.retain_freed_memory()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class KernelTimer:
    """The time this rank spends inside its attention kernels (every call's forward and its
    backward), apart from the operator's data path and collectives, whose waits follow the
    slowest rank: what a rank's own attention work costs (`system.cost_model = online` fits
    it). A context-manager factory (`ExecEnv.kernel_timer`): on the CPU the calling thread's
    CPU time with one intra-op thread (as `libra train` gives each of several local workers),
    else wall time; on a GPU CUDA events on the current stream, read once per step
    (`seconds`)."""

    def __init__(self):
        self._host = 0.0
        self._events: list = []

    @contextlib.contextmanager
    def __call__(self):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((start, end))
            return
        clock = cpu_clock()
        t0 = clock()
        try:
            yield
        finally:
            self._host += clock() - t0

    def seconds(self) -> float:
        """The kernels' seconds since the last reset (waits for the last event on a GPU)."""
        if not self._events:
            return self._host
        self._events[-1][1].synchronize()
        return self._host + sum(a.elapsed_time(b) for a, b in self._events) / 1e3

    def reset(self) -> None:
        self._host = 0.0
        self._events.clear()


_patch_lock = threading.Lock()


@dataclass
class CallCounts:
    """Counts of one forward or one backward of one core-attention call."""

    kernel_calls: int = 0
    host_copies: int = 0
    host_reads: int = 0


@dataclass
class RuntimeStats:
    """Per-call counters folded into maxima since the last reset: `kernel_calls_fwd`,
    `kernel_calls_bwd`, `tiles_executed`, `exec_blocks`, `host_copies`, `host_reads`."""

    count_host: bool = False
    """Count host copies and reads inside forward/backward (slows the call; tests, verify)."""
    max: dict = field(default_factory=dict)

    def _note(self, key: str, value: int) -> None:
        self.max[key] = max(self.max.get(key, 0), int(value))

    def summary(self) -> dict:
        keys = ("kernel_calls_fwd", "kernel_calls_bwd", "tiles_executed", "exec_blocks",
                "host_copies", "host_reads")
        return {k: self.max.get(k, 0) for k in keys}

    def reset(self) -> None:
        self.max.clear()

    @contextlib.contextmanager
    def watch(self, phase: str, tiles: int | None = None, blocks: int | None = None):
        """Count one forward (phase "fwd") or backward ("bwd"): kernel calls as the operator
        reports them on the yielded CallCounts, host copies and reads when count_host is on;
        `tiles` plan tiles and `blocks` execution blocks (local tiles, each exchange chunk with
        work for this rank) of the call."""
        counts = CallCounts()
        if tiles is not None:
            self._note("tiles_executed", tiles)
        if blocks is not None:
            self._note("exec_blocks", blocks)
        with _counting_host(counts) if self.count_host else contextlib.nullcontext():
            yield counts
        self._note(f"kernel_calls_{phase}", counts.kernel_calls)
        self._note("host_copies", counts.host_copies)
        self._note("host_reads", counts.host_reads)


@contextlib.contextmanager
def _counting_host(counts: CallCounts):
    """Count host copies and reads into `counts` inside the block."""
    original = torch.from_numpy

    def from_numpy(a):
        counts.host_copies += 1
        return original(a)

    with _patch_lock:
        torch.from_numpy = from_numpy
    try:
        with _HostCopyMode(counts):
            yield
    finally:
        with _patch_lock:
            torch.from_numpy = original
