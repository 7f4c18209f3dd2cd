"""Libra's core attention in Megatron-LM's model: the process's attention runtime (made once, on
megatron-core's groups) and `layer_spec`, the `GPTModelConfig.transformer_layer_spec` that puts
it into megatron-core's GPT layer with the weights `libra train` draws."""

from __future__ import annotations

import contextlib
import functools

import torch
from megatron.core import parallel_state as ps
from megatron.training import get_args, get_timers

from libra_ext.attention.core import Runtime
from megatron.libra import model as libra_model
from megatron.libra import rope
from megatron.libra.config import resolve_impl
from megatron.libra.megatron_lm.args import train_config
from megatron.libra.steps import new_runtime

_RUNTIME: list = [None]


def runtime(args) -> Runtime:
    """This process's attention runtime (made once, on megatron-core's groups)."""
    if _RUNTIME[0] is None:
        # the operator's Ulysses all-to-all runs on megatron-core's own CP group
        _RUNTIME[0] = new_runtime(train_config(args), ps.get_data_parallel_world_size(),
                                  ps.get_context_parallel_group())
        if args.timing_log_level >= 2:  # the exchange's waits among Megatron-LM's timers
            _RUNTIME[0].wait_timer = functools.partial(_timed, "libra-pool-exchange-wait")
    return _RUNTIME[0]


@contextlib.contextmanager
def _timed(name: str):
    """Megatron-LM's timer `name` (log level 2) around the block."""
    timer = get_timers()(name, log_level=2)
    timer.start()
    try:
        yield
    finally:
        timer.stop()


def layer_spec(config=None, vp_stage=None):
    """GPTModelConfig.transformer_layer_spec: megatron-core's GPT layer with Libra's core
    attention (TE spec where TE imports on a GPU, local otherwise)."""
    args = get_args()
    rope.install()  # THD RoPE from each slot's position: a fixed number of kernels
    cfg = train_config(args)
    impl = resolve_impl("auto" if args.transformer_impl != "local" else "local")
    # each layer's weights drawn from a generator seeded by (--seed, its global layer number),
    # and the embedding from --seed itself, as `libra train` draws them: the same model at any
    # pipeline layout, and in both loops. Megatron-LM builds the model right after asking for
    # its spec; weights made on a GPU draw from megatron-core's CUDA RNG tracker instead
    if args.use_cpu_initialization and not vp_stage:
        torch.manual_seed(cfg.data.seed)
    return libra_model.layer_spec(cfg.model, args.libra_system, runtime(args), impl,
                                  init_seed=cfg.data.seed)
