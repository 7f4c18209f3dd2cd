"""Library warnings that do not concern a Libra user, silenced in the launcher and in every
worker before megatron-core is imported: megatron-core's notice that Transformer Engine and apex
are absent (the CPU path, by design) and the deprecation notices that megatron-core's and
PyTorch's distributed-checkpoint code raise on every save and load (about their own internals,
not about anything in a config). megatron-core 0.19 and a CUDA build of PyTorch on a host
without a GPU add a few of their own, some through `logging` (LOGGED_NOTICES): that no CUDA
runtime is found (a CPU run, by design), that megatron-core's GPTModel and its own async save
strategy are deprecated in favour of classes Libra does not use, that absl is absent, and that
its MIMO config is experimental, and that TE (absent, read as version 0.0.0) is too old for
MoE experts. Every other warning still shows."""

from __future__ import annotations

import logging
import re
import warnings

MEGATRON_NOTICES = (
    (r"Transformer Engine and Apex are not installed", UserWarning),
    (r"full scope is deprecated", UserWarning),
    (r"`load_state_dict` is deprecated and will be removed", FutureWarning),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning),
    (r"absl\.logging is not installed", UserWarning),
    (r"MimoModelConfig is experimental", UserWarning),
    # TE's version read as 0.0.0: TE is absent (the CPU path); an old TE still warns
    (r"Only transformer-engine>=1\.7\.0 supports MoE experts, but your version is 0\.0\.0",
     UserWarning),
)

LOGGED_NOTICES = (
    ("torch.utils.cpp_extension", r"No CUDA runtime is found"),
    ("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED"),
    ("megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated"),
)
"""(logger, message pattern) of notices made through `logging` rather than `warnings`."""


class _DropNotice(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_megatron_notices() -> None:
    for text, category in MEGATRON_NOTICES:
        warnings.filterwarnings("ignore", message=text, category=category)
    for name, pattern in LOGGED_NOTICES:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) and f.pattern.pattern == pattern
                   for f in log.filters):
            log.addFilter(_DropNotice(pattern))
