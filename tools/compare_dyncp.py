"""Dev-time check: the project's `megatron-dyncp` peer against Megatron-LM's own dynamic-CP
scheduler on the same steps.

Megatron-LM's scheduler lives in `megatron/core/datasets/data_schedule_utils.py` on its dev
branch (`next_hdp_group_packing_aware`, driven by `DefaultDynamicCPScheduler`). Give this script
that file from a Megatron-LM checkout, e.g.

    git -C Megatron-LM show dev:megatron/core/datasets/data_schedule_utils.py > /tmp/dsu.py
    python tools/compare_dyncp.py --megatron-file /tmp/dsu.py

It takes the scheduler's functions from the file as they are (the module's torch and Transformer
Engine imports are not needed for them), drives them the way `DefaultDynamicCPScheduler.
get_groups_and_subsamples` does (no VPP alignment), runs the project's `dynamic_cp_schedule` on
the same documents, and prints per-GPU attention work max/mean two ways for both:

- per-GPU sums: the busiest GPU's work over the step / the mean GPU's;
- lock-step: the busiest GPU of each micro-batch, summed over micro-batches / the mean GPU's
  work (what the simulator times: micro-batches run in lock-step);

with work = length^2 / (GPUs holding the document in its micro-batch). It also counts the steps
whose assignments differ. Not part of the test suite: it needs Megatron-LM's source.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from functools import lru_cache
from math import ceil, log2
from pathlib import Path
from typing import Callable, Dict, List, Literal, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libra_ext.simulator import dcp  # noqa: E402
from libra_ext.workload import LengthSource  # noqa: E402

NEEDED = ("_DYNAMIC_CP_WORKLOAD_CAP_DELTA", "dcp_gpus_needed", "next_hdp_group_packing_aware")

SCENARIOS = {  # the project's paper steps: preset, GBS, DP, CP (context 256K / 1M)
    "256k": ("libra-256k", 128, 16, 8, 262_144),
    "1m": ("libra-1m", 32, 16, 16, 1_048_576),
}


def load_megatron(path: Path) -> Callable:
    """Megatron's `next_hdp_group_packing_aware` (and what it calls) from its source file."""
    tree = ast.parse(path.read_text())
    keep = []
    for node in tree.body:
        name = (node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else
                node.targets[0].id if isinstance(node, ast.Assign)
                and isinstance(node.targets[0], ast.Name) else None)
        if name in NEEDED:
            keep.append(node)
    missing = set(NEEDED) - {getattr(n, "name", None) or n.targets[0].id for n in keep}
    if missing:
        raise SystemExit(f"{path}: no {sorted(missing)} (is it Megatron-LM dev's "
                         "data_schedule_utils.py?)")
    ns = {"lru_cache": lru_cache, "ceil": ceil, "log2": log2, "Callable": Callable,
          "Dict": Dict, "List": List, "Literal": Literal, "Optional": Optional,
          "Sequence": Sequence, "Tuple": Tuple}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), ns)
    return ns["next_hdp_group_packing_aware"]


def megatron_rounds(fn: Callable, lengths: list[int], n_gpus: int, cap: int) -> list:
    """DefaultDynamicCPScheduler.get_groups_and_subsamples, without VPP alignment."""
    pending = sorted(enumerate(lengths), key=lambda x: x[1], reverse=True)
    rounds = []
    while pending:
        _, pending, _, ids = fn(pending, n_gpus, max_seq_len_per_rank=cap, min_cp_size=1)
        rounds.append(ids)
    return rounds


def figures(rounds: list, lengths: list[int], n_gpus: int) -> tuple[list[float], float]:
    """(work per GPU over the step, sum over micro-batches of the busiest GPU's work)."""
    per_gpu, lock = [0.0] * n_gpus, 0.0
    for ids_per_gpu in rounds:
        holders: dict[int, int] = {}
        for ids in ids_per_gpu:
            for i in ids:
                holders[i] = holders.get(i, 0) + 1
        w = [sum(lengths[i] ** 2 / holders[i] for i in ids) for ids in ids_per_gpu]
        for g in range(n_gpus):
            per_gpu[g] += w[g]
        lock += max(w)
    return per_gpu, lock


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron-file", type=Path, required=True,
                    help="Megatron-LM dev's megatron/core/datasets/data_schedule_utils.py")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scenarios", default="256k,1m")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    fn = load_megatron(args.megatron_file)
    out = {}
    print("| scenario | scheduler | per-GPU sums max/mean | lock-step max/mean | micro-batches "
          "| seconds |")
    print("|---|---|---|---|---|---|")
    for name in args.scenarios.split(","):
        preset, gbs, dp, cp, context = SCENARIOS[name]
        n_gpus, cap = dp * cp, context // cp
        source = LengthSource(preset=preset)
        acc = {"megatron": [[], [], 0, 0.0], "project": [[], [], 0, 0.0]}
        differ = 0
        for step in range(args.steps):
            lengths = [int(l) for s in source.step(gbs, context, args.seed, step) for l in s]
            got = {}
            for who in acc:
                t0 = time.perf_counter()
                got[who] = (megatron_rounds(fn, lengths, n_gpus, cap) if who == "megatron"
                            else dcp.dynamic_cp_schedule(lengths, n_gpus, cap))
                acc[who][3] += time.perf_counter() - t0
                per_gpu, lock = figures(got[who], lengths, n_gpus)
                mean = sum(per_gpu) / n_gpus
                acc[who][0].append(max(per_gpu) / mean)
                acc[who][1].append(lock / mean)
                acc[who][2] += len(got[who])
            differ += got["megatron"] != got["project"]
        out[name] = {"steps_with_different_assignments": differ}
        for who, (sums, locks, mbs, secs) in acc.items():
            row = {"per_gpu_sums": sum(sums) / len(sums), "lock_step": sum(locks) / len(locks),
                   "micro_batches": mbs, "seconds": secs}
            out[name][who] = row
            print(f"| {name} | {who} | {row['per_gpu_sums']:.4f} | {row['lock_step']:.4f} | "
                  f"{mbs} | {secs:.1f} |")
        print(f"| {name} | steps whose assignments differ | {differ} of {args.steps} | | | |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
