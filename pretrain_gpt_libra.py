#!/usr/bin/env python3
"""Pretrain a GPT with Libra's attention scheduling inside Megatron-LM's own training loop.

    torchrun --nproc-per-node 4 pretrain_gpt_libra.py <Megatron-LM's arguments> \\
        --libra-system libra --libra-pool-size 2

Megatron-LM's arguments (or --yaml-cfg), iteration log line, timers, TensorBoard, checkpoints
and exit-signal handling are its own; Libra adds the --libra-* arguments, its core attention in
megatron-core's GPT layer, and the step plan that decides which rank runs which sample
(megatron/libra/megatron_lm/). Needs megatron-core >= 0.19 (Python >= 3.12).
"""

import sys

from megatron.libra.notices import quiet_megatron_notices

quiet_megatron_notices()  # before megatron-core is imported: its notices on a host without a GPU
from megatron.libra.megatron_lm.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
