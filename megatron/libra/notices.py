"""Library warnings that do not concern a Libra user, silenced in the launcher and in every
worker before megatron-core is imported: megatron-core's notice that Transformer Engine and apex
are absent (the CPU path, by design) and the deprecation notices that megatron-core's and
PyTorch's distributed-checkpoint code raise on every save and load (about their own internals,
not about anything in a config)."""

from __future__ import annotations

import warnings

MEGATRON_NOTICES = (
    (r"Transformer Engine and Apex are not installed", UserWarning),
    (r"full scope is deprecated", UserWarning),
    (r"`load_state_dict` is deprecated and will be removed", FutureWarning),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
)


def quiet_megatron_notices() -> None:
    for text, category in MEGATRON_NOTICES:
        warnings.filterwarnings("ignore", message=text, category=category)
