"""CPU shims for megatron-core: what it takes to run megatron-core on CPU with gloo.

Applied only when no GPU is present (`apply()` is a no-op otherwise), each shim is small and
named, and tests/test_cpu_shims.py shows for each one that megatron-core fails on CPU without it:

- `rng_tracker`: megatron-core's model-parallel RNG tracker stores and swaps CUDA generator
  states; on CPU it tracks the CPU generator state instead.
- `current_device`: `torch.cuda.current_device()` (rotary embeddings, buffers) answers "cpu".
- `cuda_literals`: literal `device="cuda"` tensors in the schedules, the optimizer and the
  gradient clipping are made on the CPU (those modules see a `torch` whose tensor factories map
  the device "cuda" to "cpu").
- `grad_clip_fp32`: gradient clipping asserts fp32 grads are `torch.cuda.FloatTensor`; on CPU it
  checks for float32 (or float64, for exact comparisons) and scales the grads in place.
- `moe_without_te`: megatron-core 0.16's MoE router reads a Transformer Engine GEMM name that is
  only defined when TE imports; without TE (always the case on CPU) it is defined as absent, so
  the router takes its PyTorch path (0.19 defines it itself).
- `checkpoint_preload`: the dist-checkpointing writer copies tensors to host memory with
  `non_blocking=True` and then calls `torch.cuda.synchronize()`; on CPU it copies blocking and
  synchronizes nothing.
- `async_checkpoint`: the asynchronous checkpoint caller calls `torch.cuda.synchronize()` before
  it starts the writer process; on CPU there is nothing to synchronize.
- `recompute_rng`: activation recompute (megatron-core's CheckpointFunction) saves and restores
  the CUDA generator's state with the CPU one's; on CPU there is no CUDA generator, so only the
  CPU state and the tracker's are kept.
- `tied_embeddings`: with the input embedding shared by the output layer, megatron-core moves
  the shared weight to the GPU (`.cuda()`) before summing the first and last stage's copies; on
  CPU the weight stays where it is.
- `p2p_synchronize`: the pipeline stages' point-to-point exchange calls `torch.cuda.synchronize()`
  after each batched send / receive (and its shape exchange); on CPU gloo's requests are already
  waited for and there is nothing to synchronize.
- `grad_sync_stream`: megatron-core 0.19's gradient reduction first orders itself after CUDA-graph
  replays on `torch.cuda.current_stream()`, which a CUDA build of torch refuses without a
  driver; on CPU that stream is one where everything already ran in order.

- `megatron_training`: megatron-core 0.19's `megatron.training` (Megatron-LM's `pretrain` loop,
  its start-up, timers, rerun state machine and model builder) makes `device="cuda"` tensors for
  its flags and loss sums, asks `torch.cuda` for a device, streams, events, RNG states and memory
  statistics, and synchronizes; those modules see a `torch` whose factories put "cuda" tensors
  on the CPU and whose `cuda` is one CPU device (`_CudaOnCpu`: streams where everything already
  ran in order, events that read the host clock, no RNG state of its own, zero memory figures),
  and whose `device("cuda:<index>")` (its packed-sequence FLOPs statistics, its meta-device
  model materialization) is the CPU.

A shim some megatron-core versions do not need (`APPLIES`) is left out where the installed one
has nothing for it to patch.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import time
import types

import megatron.core
import torch
from megatron.core import parallel_state as ps

_APPLIED: set[str] = set()


def needed() -> bool:
    return not torch.cuda.is_available()


# --- rng_tracker ----------------------------------------------------------------------------


def _cpu_tracker_class(random_mod):
    base = random_mod.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):
        """The model-parallel RNG tracker over the CPU generator."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=random_mod._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def _shim_rng_tracker() -> None:
    random_mod = importlib.import_module("megatron.core.tensor_parallel.random")
    tracker_cls = _cpu_tracker_class(random_mod)
    random_mod.CudaRNGStatesTracker = tracker_cls

    def manual_seed(seed: int, *args, **kwargs) -> None:
        """CPU stand-in for model_parallel_cuda_manual_seed: same offsets, CPU generator."""

        offset = seed + 2718
        tp_seed = offset + ps.get_tensor_model_parallel_rank()
        random_mod._CUDA_RNG_STATE_TRACKER = tracker_cls()
        random_mod._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        tracker = random_mod._CUDA_RNG_STATE_TRACKER
        torch.manual_seed(seed)
        tracker.add(random_mod._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
        tracker.add(random_mod._MODEL_PARALLEL_RNG_TRACKER_NAME, tp_seed)
        expert_seed = (
            seed
            + 1024
            + 100 * ps.get_expert_model_parallel_rank()
            + ps.get_expert_tensor_parallel_rank()
        )
        tracker.add(random_mod._EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_seed)

    random_mod.model_parallel_cuda_manual_seed = manual_seed
    tp = importlib.import_module("megatron.core.tensor_parallel")
    tp.model_parallel_cuda_manual_seed = manual_seed


# --- current_device -------------------------------------------------------------------------


def _shim_current_device() -> None:
    torch.cuda.current_device = lambda: "cpu"


# --- cuda_literals --------------------------------------------------------------------------


def _cpu_device(kwargs: dict) -> dict:
    dev = kwargs.get("device")
    if dev is not None and str(dev).startswith("cuda"):
        kwargs = dict(kwargs, device="cpu")
    return kwargs


def _torch_view(name: str) -> types.ModuleType:
    """A copy of `torch`'s namespace, for one module to see with some names replaced."""
    view = types.ModuleType(name)
    view.__dict__.update(torch.__dict__)
    return view


def _torch_on_cpu(more: tuple[str, ...] = ()) -> types.ModuleType:
    """A view of `torch` whose tensor factories put device="cuda" tensors on the CPU."""
    proxy = _torch_view("torch_on_cpu")
    for name in ("zeros", "ones", "empty", "tensor", "full", "arange") + more:
        fn = getattr(torch, name)
        setattr(proxy, name, (lambda f: lambda *a, **k: f(*a, **_cpu_device(k)))(fn))
    return proxy


CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",  # the local (non-apex) multi-tensor l2 norm
)


def _shim_cuda_literals() -> None:
    proxy = _torch_on_cpu()
    for name in CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = proxy


# --- grad_clip_fp32 -------------------------------------------------------------------------


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron-core's clip_grad_by_total_norm_fp32 with a device-neutral fp32 check."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for p in parameters:
        g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
        if g is None:
            continue
        if not use_decoupled_grad and g.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"gradient clipping expects fp32 (or fp64) grads, got {g.dtype}")
        grads.append(g.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.mul_(clip_coeff)


def _shim_grad_clip_fp32() -> None:
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        importlib.import_module(name).clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32


def _shim_moe_without_te() -> None:
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# --- checkpoint_preload ---------------------------------------------------------------------


def _shim_checkpoint_preload() -> None:
    fsa = importlib.import_module("megatron.core.dist_checkpointing.strategies.filesystem_async")
    writer = fsa.FileSystemWriterAsync
    preload = writer.preload_tensors

    def preload_tensors(write_buckets, non_blocking=True):
        """The checkpoint writer's host copy; on CPU a plain (blocking) copy, so there is no
        CUDA stream to synchronize."""
        return preload(write_buckets, non_blocking=False)

    writer.preload_tensors = staticmethod(preload_tensors)


# --- async_checkpoint -----------------------------------------------------------------------


class _NoStream:
    """A CUDA stream where there is none: what is ordered on it already ran in order."""

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def record_event(self, event=None):
        return event

    def synchronize(self) -> None:
        return None


class _CudaWithoutStreams(types.ModuleType):
    """`torch.cuda` as a module that orders its work on streams sees it on CPU: nothing to
    synchronize, and the current stream is one where everything already ran in order."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def current_stream(device=None) -> _NoStream:
        return _NoStream()


def _torch_without_cuda_streams() -> types.ModuleType:
    proxy = _torch_view("torch_without_cuda_streams")
    proxy.cuda = _CudaWithoutStreams("torch.cuda")
    return proxy


def _shim_async_checkpoint() -> None:
    au = importlib.import_module("megatron.core.dist_checkpointing.strategies.async_utils")
    au.torch = _torch_without_cuda_streams()


# --- recompute_rng --------------------------------------------------------------------------


def _shim_recompute_rng() -> None:
    random_mod = importlib.import_module("megatron.core.tensor_parallel.random")
    random_mod._get_cuda_rng_state = lambda *args, **kwargs: None
    random_mod._set_cuda_rng_state = lambda *args, **kwargs: None


# --- tied_embeddings ------------------------------------------------------------------------


def _shim_tied_embeddings() -> None:
    lm = importlib.import_module("megatron.core.models.common.language_module.language_module")
    setup = lm.LanguageModule.setup_embeddings_and_output_layer

    def setup_on_cpu(self):
        """megatron-core's set-up with the shared weight's `.cuda()` kept on the CPU."""
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *args, **kwargs: t
        try:
            return setup(self)
        finally:
            torch.Tensor.cuda = cuda

    lm.LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu


# --- p2p_synchronize ------------------------------------------------------------------------


def _shim_p2p_synchronize() -> None:
    p2p = importlib.import_module("megatron.core.pipeline_parallel.p2p_communication")
    p2p.torch = _torch_without_cuda_streams()


# --- grad_sync_stream -----------------------------------------------------------------------

GRAD_BUFFERS = "megatron.core.distributed.param_and_grad_buffer"


# --- megatron_training ----------------------------------------------------------------------


class _HostEvent:
    """A CUDA event where there is none: recorded and timed on the host clock."""

    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, stream=None) -> None:
        self._t = time.perf_counter()

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end._t - self._t) * 1e3

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        return None


class _CudaOnCpu(_CudaWithoutStreams):
    """`torch.cuda` as Megatron-LM's training loop sees it on CPU: one device (the CPU), whose
    streams ran everything in order, whose events read the host clock, with no RNG state of its
    own (the CPU generator's is kept beside it) and no memory to report."""

    is_available = staticmethod(lambda: True)
    device_count = staticmethod(lambda: 1)
    current_device = staticmethod(lambda: "cpu")
    set_device = staticmethod(lambda device: None)
    empty_cache = staticmethod(lambda: None)
    memory_stats = staticmethod(lambda device=None: {})
    memory_allocated = staticmethod(lambda device=None: 0)
    max_memory_allocated = staticmethod(lambda device=None: 0)
    memory_reserved = staticmethod(lambda device=None: 0)
    max_memory_reserved = staticmethod(lambda device=None: 0)
    reset_peak_memory_stats = staticmethod(lambda device=None: None)
    Stream = staticmethod(lambda *args, **kwargs: _NoStream())
    stream = staticmethod(lambda stream=None: contextlib.nullcontext())
    Event = _HostEvent
    get_device_properties = staticmethod(
        lambda device=None: types.SimpleNamespace(name="cpu", major=0, minor=0, total_memory=0))
    get_device_capability = staticmethod(lambda device=None: (0, 0))
    get_rng_state = staticmethod(lambda device="cuda": torch.empty(0, dtype=torch.uint8))
    set_rng_state = staticmethod(lambda state, device="cuda": None)


def _device_on_cpu(*args, **kwargs) -> torch.device:
    """torch.device, with any "cuda" device the CPU (also f"cuda:{torch.cuda.current_device()}",
    which is "cuda:cpu" here)."""
    if args and isinstance(args[0], str) and args[0].startswith("cuda"):
        return torch.device("cpu")
    d = torch.device(*args, **kwargs)
    return torch.device("cpu") if d.type == "cuda" else d


MEGATRON_TRAINING_MODULES = (
    "megatron.training.arguments",
    "megatron.training.training",
    "megatron.training.initialize",
    "megatron.training.checkpointing",
    "megatron.training.utils.common_utils",
    "megatron.training.utils.utils",
    "megatron.training.models.dist_utils",
    "megatron.core.timers",
    "megatron.core.rerun_state_machine",
)


def _shim_megatron_training() -> None:
    proxy = _torch_on_cpu(("rand", "randn", "zeros_like", "ones_like", "empty_like", "full_like"))
    proxy.cuda = _CudaOnCpu("torch.cuda")
    proxy.device = _device_on_cpu
    for name in MEGATRON_TRAINING_MODULES:
        importlib.import_module(name).torch = proxy


def _has_megatron_training() -> bool:
    return importlib.util.find_spec("megatron.training") is not None


def _shim_grad_sync_stream() -> None:
    importlib.import_module(GRAD_BUFFERS).torch = _torch_without_cuda_streams()


def _source_mentions(module: str, text: str) -> bool:
    return text in inspect.getsource(importlib.import_module(module))


def _moe_router_lacks_te_gemm() -> bool:
    return not hasattr(importlib.import_module("megatron.core.transformer.moe.moe_utils"),
                       "te_general_gemm")


APPLIES = {
    "grad_sync_stream": (lambda: _source_mentions(GRAD_BUFFERS, "torch.cuda.current_stream"),
                         "its gradient reduction does not call torch.cuda.current_stream"),
    "moe_without_te": (_moe_router_lacks_te_gemm,
                       "its MoE utilities define te_general_gemm without Transformer Engine"),
    "megatron_training": (_has_megatron_training, "its wheel ships no megatron.training"),
}
"""Shims only some megatron-core versions need: when the installed one has nothing for the shim
to patch, `apply` leaves it out (and its test says why)."""


def applies(name: str) -> tuple[bool, str]:
    """Whether the installed megatron-core has what shim `name` patches, and if not, why not."""

    if name not in APPLIES:
        return True, ""
    test, why = APPLIES[name]
    return (True, "") if test() else (False, f"megatron-core {megatron.core.__version__}: {why}")


SHIMS = {
    "rng_tracker": _shim_rng_tracker,
    "current_device": _shim_current_device,
    "cuda_literals": _shim_cuda_literals,
    "grad_clip_fp32": _shim_grad_clip_fp32,
    "moe_without_te": _shim_moe_without_te,
    "checkpoint_preload": _shim_checkpoint_preload,
    "async_checkpoint": _shim_async_checkpoint,
    "p2p_synchronize": _shim_p2p_synchronize,
    "recompute_rng": _shim_recompute_rng,
    "tied_embeddings": _shim_tied_embeddings,
    "grad_sync_stream": _shim_grad_sync_stream,
    "megatron_training": _shim_megatron_training,
}


def apply(only: tuple[str, ...] | None = None, force: bool = False) -> list[str]:
    """Apply the shims (all, or `only` these) when no GPU is present; returns those applied now.
    `force` applies them even with a GPU (tests only)."""
    if not (needed() or force):
        return []
    done = []
    for name in only or tuple(SHIMS):
        if name not in SHIMS:
            raise ValueError(f"unknown shim {name!r} (known: {', '.join(SHIMS)})")
        if name not in _APPLIED and applies(name)[0]:
            SHIMS[name]()
            _APPLIED.add(name)
            done.append(name)
    return done
