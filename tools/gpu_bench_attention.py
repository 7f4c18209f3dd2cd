#!/usr/bin/env python3
"""Time the core-attention operator against one plain varlen call over the same packed
sequence (world size 1), forward + backward, side by side, with the runtime's counters.
Same as `libra bench attention`; kept as a script for machines without the `libra` entry point.

    python tools/gpu_bench_attention.py [--context 262144] [--out out/bench_attention.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.libra.cli.bench import bench_attention_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_attention_main(sys.argv[1:]))
