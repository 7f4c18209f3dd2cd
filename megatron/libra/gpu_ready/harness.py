"""Fake CUDA on a CPU-only PyTorch, and a probe of what device code does with it.

Under `torch._subclasses.fake_tensor.FakeTensorMode`, tensors on ``device="cuda"`` carry shape,
dtype and device but no data, so every op runs without a GPU: a host tensor meeting a device
tensor raises `FakeTensorDeviceMismatchError`, and a device value read on the host (`.item()`,
`.tolist()`, boolean-mask indexing, `nonzero`) raises `DataDependentOutputException` /
`DynamicOutputShapeException`. Two things a CPU-only build lacks are supplied by a small
library (`fake_cuda_guard.cpp`) preloaded into the gate's own process: a CUDA device guard
(Python bindings open one for slicing, copies and `.to("cuda")`) and CUDA hooks that report one
device (the autograd engine asks for "the accelerator" before a backward through device
tensors). Pinned host memory is marked, not allocated.

`Probe` (a TorchDispatchMode inside the fake mode) records, per phase ("setup", "fwd", "bwd"):
device ops (what would be kernel launches: every op with a CUDA output that is not a view or a
bare allocation - device-to-device copies included - and each fused row op of
`libra_ext.attention.rowops`, which writes its first argument in place), host-to-device
copies (blocking, or from memory that is not pinned, is a sync), device-to-host copies, host
reads of device values, and the live bytes of device tensors (each non-view output counted until
it is freed), with their peak.

Only the gate's process loads any of this (`megatron.libra.gpu_ready.__main__` re-executes itself
with the library preloaded); it refuses to run where a real GPU is present.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import traceback
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from libra_ext.attention import counters
from libra_ext.measure import traffic
from megatron.libra.gpu_ready.library import LIB_NAME, PRELOAD_ENV, ROOT as _ROOT


def real_gpus() -> int:
    """GPUs the CUDA runtime sees (0 on a CPU-only build), asked of the runtime itself, not of
    the hooks this library replaces."""
    if torch.version.cuda is None:
        return 0
    return int(torch._C._cuda_getDeviceCount())


def activate() -> None:
    """In the preloaded process: check that the fake device is in place."""
    lib = os.environ.get(PRELOAD_ENV)
    if not lib:
        raise RuntimeError("the fake-CUDA library is not preloaded (run python -m "
                           "megatron.libra.gpu_ready)")
    if real_gpus() > 0:
        raise RuntimeError("the gate fakes CUDA where no GPU is present; this machine has one")

    spec = importlib.util.spec_from_file_location(LIB_NAME, lib)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not mod.install():
        raise RuntimeError("the fake CUDA hooks did not take: something asked for CUDA hooks "
                           "before the preloaded library registered its own")


# ----------------------------------------------------------------------------------------------
# The probe
# ----------------------------------------------------------------------------------------------

_aten = torch.ops.aten
_NOT_KERNELS = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten.detach.default,
    _aten.lift_fresh.default, _aten._to_copy.default, _aten.copy_.default,
}
"""Ops with a device output that launch no kernel (allocations, metadata) or are counted as
transfers."""
_ALLOCATIONS = _NOT_KERNELS - {_aten._to_copy.default, _aten.copy_.default}
"""Ops that move no device bytes (device-to-device copies do: they count in `op_bytes`)."""
_HOST_READS = {_aten._local_scalar_dense.default, _aten.nonzero.default,
               _aten.masked_select.default, _aten.unique_consecutive.default,
               _aten._unique2.default}
"""Ops that read a device value on the host (nonzero_static, whose size is given, does not)."""


def _device_copy(func, args, kwargs) -> bool:
    """A copy from the device to the device (a launch, unlike an upload or download)."""
    if func is _aten.copy_.default:
        return len(args) >= 2 and _is_cuda(args[0]) and _is_cuda(args[1])
    if func is _aten._to_copy.default:
        dst = kwargs.get("device")
        return bool(args) and _is_cuda(args[0]) and (dst is None or
                                                     torch.device(dst).type == "cuda")
    return False


def _where() -> str:
    """The innermost project frame of the current stack (file:line function)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        f = frame.filename
        if ("libra_ext" in f or "megatron/libra" in f) and "gpu_ready" not in f:
            return f"{Path(f).relative_to(_ROOT) if f.startswith(str(_ROOT)) else f}:" \
                   f"{frame.lineno} {frame.name}"
    return "?"


def _is_cuda(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cuda"


def _touches_device(args, kwargs) -> bool:
    """Whether an op involves the fake device: a fake tensor among its arguments, or a CUDA
    device asked for."""

    def hit(a) -> bool:
        if isinstance(a, FakeTensor):
            return True
        if isinstance(a, torch.device):
            return a.type == "cuda"
        if isinstance(a, str):
            return a.startswith("cuda")
        if isinstance(a, (list, tuple)):
            return any(hit(x) for x in a)
        return False

    return any(hit(a) for a in args) or any(hit(v) for v in kwargs.values())


def _outputs(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    return []


@dataclass
class Phase:
    """What one phase of device code did."""

    ops: Counter = field(default_factory=Counter)
    """Device ops (kernel launches) by op name."""
    h2d: list = field(default_factory=list)
    """(bytes, non_blocking, pinned, where) of every host-to-device copy."""
    d2h: list = field(default_factory=list)
    """(bytes, non_blocking, pinned, where) of every device-to-host copy."""
    reads: list = field(default_factory=list)
    """(op, where) of every host read of a device value."""
    allowed: list = field(default_factory=list)
    """(name, where) of every host read a stand-in made in place of an inherent one (see
    `gate.ALLOWED_READS`)."""
    start_live: int = 0
    """Live device bytes when the phase began."""
    peak_live: int = 0
    """The most live device bytes during the phase."""
    end_live: int = 0
    """Live device bytes when the next phase began."""
    at_peak: list = field(default_factory=list)
    """With tracing: the largest live device tensors (bytes, op, where) at the peak."""
    bytes_by_op: Counter = field(default_factory=Counter)
    """Device bytes read + written by op name (kernels and views excluded by the caller)."""

    @property
    def kernels(self) -> int:
        return sum(self.ops.values())

    @property
    def blocking(self) -> list:
        """Transfers that make the host wait: copies that are blocking or whose host side is
        not pinned memory, either way (an event's synchronize counts as one)."""
        return [x for x in self.h2d + self.d2h if not (x[1] and x[2])]


def op_bytes(func, args, kwargs, out) -> int:
    """Device bytes an op reads and writes (`libra_ext.measure.traffic.op_bytes` on the fake
    device)."""
    return traffic.op_bytes(func, args, kwargs, out, _is_cuda)


class Probe(TorchDispatchMode):
    """Counts device ops, transfers, host reads and live device bytes (see the module)."""

    def __init__(self):
        super().__init__()
        self.phases: dict[str, Phase] = {}
        self.phase = "setup"
        self.live = 0
        self.trace = bool(os.environ.get("LIBRA_GATE_TRACE"))
        """Record the live device tensors (bytes, op, where) at each phase's peak."""
        self._alive: dict = {}
        self._holders: dict = {}  # live storage -> its bytes

    def __enter__(self):
        counters.on_storage_resize(self._resized)
        return super().__enter__()

    def __exit__(self, *exc):
        counters.on_storage_resize(None)
        return super().__exit__(*exc)

    def _resized(self, storage, before: int, after: int) -> None:
        self.live += traffic.resized(self._holders, storage, before, after)
        ph = self.current()
        ph.peak_live = max(ph.peak_live, self.live)

    def start(self, name: str) -> Phase:
        """Begin phase `name` (events and the peak are attributed to it until the next; a
        phase started again starts over)."""
        self.current().end_live = self.live
        self.phase = name
        ph = self.phases[name] = Phase(start_live=self.live, peak_live=self.live)
        return ph

    def current(self) -> Phase:
        return self.phases.setdefault(self.phase, Phase())

    def _free(self, key: int) -> None:
        self.live -= self._holders.pop(key)
        self._alive.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _touches_device(args, kwargs):  # host math on host tensors runs for real

            with _disable_current_modes():
                return func(*args, **kwargs)
        ph = self.current()
        if func in _HOST_READS and any(_is_cuda(a) for a in args):
            ph.reads.append((str(func), _where()))
        if func is _aten._to_copy.default and args and isinstance(args[0], torch.Tensor):
            src, dst = args[0].device.type, torch.device(kwargs.get("device", args[0].device)).type
            self._transfer(ph, src, dst, args[0], kwargs.get("non_blocking", False))
            if dst == "cuda":  # a real host tensor goes to the fake device as a fake one
                args = (self._fake(args[0]), *args[1:])
        elif func is _aten.copy_.default and len(args) >= 2:
            nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            self._transfer(ph, args[1].device.type, args[0].device.type, args[1], nb, args[0])
            if args[0].device.type == "cuda":
                args = (args[0], self._fake(args[1]), *args[2:])
        out = func(*args, **kwargs)
        row_bytes = traffic.row_op(func, args, kwargs, _is_cuda)
        if row_bytes is not None:  # one launch, writing its first argument in place
            ph.ops[func.__name__] += 1
            ph.bytes_by_op[func.__name__] += row_bytes
            return out
        outs = [o for o in _outputs(out) if _is_cuda(o)]
        returns = func._schema.returns
        view = traffic.is_view(func)
        if outs and (func not in _NOT_KERNELS or _device_copy(func, args, kwargs)) and not view:
            ph.ops[func.__name__] += 1
        if outs and not view and func not in _ALLOCATIONS:
            nb = op_bytes(func, args, kwargs, out)
            if nb:
                ph.bytes_by_op[func.__name__] += nb
        aliasing = any(r.alias_info is not None for r in returns)
        if not aliasing:
            for o in outs:
                # counted per storage, until the storage is freed (ops without alias
                # annotations, such as _unsafe_view, return their input's); the storage, not
                # the tensor, carries the finalizer (a tensor with a weak reference cannot be
                # swapped, as Module.cuda() does with fake parameters)
                storage = o.untyped_storage()
                key = storage._cdata
                if key not in self._holders:
                    n = storage.nbytes()
                    self._holders[key] = n
                    self.live += n
                    if self.trace:
                        self._alive[key] = (n, func.__name__, _where())
                    weakref.finalize(storage, self._free, key)
            if self.live > ph.peak_live:
                ph.peak_live = self.live
                if self.trace:
                    ph.at_peak = sorted(self._alive.values(), reverse=True)[:int(os.environ.get("LIBRA_GATE_TRACE_TOP", "12"))]
        return out

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        return t if isinstance(t, FakeTensor) else self.mode.from_tensor(t)

    def _transfer(self, ph: Phase, src: str, dst: str, t: torch.Tensor, non_blocking,
                  into=None) -> None:
        nbytes = t.numel() * t.element_size()
        if src == "cpu" and dst == "cuda":
            ph.h2d.append((nbytes, bool(non_blocking), is_pinned(t), _where()))
        elif src == "cuda" and dst == "cpu":  # (`.cpu()` / `.to("cpu")` has no pinned target)
            ph.d2h.append((nbytes, bool(non_blocking), into is not None and is_pinned(into),
                           _where()))


# ----------------------------------------------------------------------------------------------
# Pinned memory, marked
# ----------------------------------------------------------------------------------------------

_PINNED: dict = {}
"""id -> weak reference of every host tensor pin_memory marked (by identity: tensors compare
elementwise)."""


def _marked(t) -> bool:
    ref = _PINNED.get(id(t))
    return ref is not None and ref() is t


def is_pinned(t: torch.Tensor) -> bool:
    return _marked(t) or (t._base is not None and _marked(t._base))


def _pin_memory(self, device=None):
    key = id(self)
    _PINNED[key] = weakref.ref(self, lambda _, k=key: _PINNED.pop(k, None))
    return self


def _is_pinned(self, device=None):
    return is_pinned(self)


class FakeEvent:
    """torch.cuda.Event on the fake device: recording is asynchronous (nothing waits); reading
    a time or synchronizing is a host wait, counted by the probe that made it."""

    probe = None

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True

    def wait(self, stream=None):
        return None

    def query(self):
        return True

    def synchronize(self):
        if FakeEvent.probe is not None:
            FakeEvent.probe.current().d2h.append((0, False, False,
                                                  f"event synchronize at {_where()}"))

    def elapsed_time(self, end):
        self.synchronize()
        return 0.0


@contextlib.contextmanager
def fake_cuda():
    """Fake CUDA tensors and the probe (yielded) for the block; pin_memory marks host tensors
    and torch.cuda reports one device."""

    activate()
    saved = (torch.Tensor.pin_memory, torch.Tensor.is_pinned, torch.cuda.is_available,
             torch.cuda.current_device, torch.cuda.device_count, torch.from_numpy, torch.tensor)
    from_numpy = torch.from_numpy

    def host_from_numpy(a):  # host memory, as on a GPU host (the fake mode would fake it)
        with _disable_current_modes():
            return from_numpy(a)

    make_tensor = torch.tensor

    def tensor(data, *args, device=None, **kwargs):
        # torch.tensor(..., device="cuda") builds on the device below the dispatch modes; built on
        # the host and moved, it becomes a fake device tensor like any other copy
        if device is not None and str(device).startswith("cuda"):
            return make_tensor(data, *args, **kwargs).to(device)
        return make_tensor(data, *args, device=device, **kwargs)

    torch.from_numpy, torch.tensor = host_from_numpy, tensor
    torch.Tensor.pin_memory, torch.Tensor.is_pinned = _pin_memory, _is_pinned
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    event = torch.cuda.Event
    torch.cuda.Event = FakeEvent
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, Probe() as probe:
            probe.mode = mode
            FakeEvent.probe = probe
            yield probe
    finally:
        torch.cuda.Event, FakeEvent.probe = event, None
        (torch.Tensor.pin_memory, torch.Tensor.is_pinned, torch.cuda.is_available,
         torch.cuda.current_device, torch.cuda.device_count, torch.from_numpy,
         torch.tensor) = saved
