"""Dev-time check: DistCA as its own planner runs it (every GPU an attention server) against the
project's `distca` (one attention server per replica) on the project's steps.

DistCA's planner lives in `distca/planner/planner.py` of hao-ai-lab/distca. Give this script that
file from a checkout, e.g.

    git -C distca show HEAD:distca/planner/planner.py > /tmp/distca_planner.py
    python tools/compare_distca.py --distca-file /tmp/distca_planner.py

It takes `Item`, `batch_to_items_general` and `Planner` from the file as they are (their torch,
rich and runtime imports are not needed to plan items: stand-ins are given), and drives them the
way DistCA's driver does for one micro-batch: the D sequences of a slot (the project's
production order) laid out over the D*C GPUs, S/C tokens each, documents cut at GPU boundaries
into head/tail pieces (`batch_to_items_general`), then `Planner.plan_items` at each tolerance
given (DistCA's driver starts at 0.05 and raises it while its communication buffer is too
small; the default tolerance of its Planner is 0.1). DistCA's item split supports even document
lengths only ("please pad to even"): odd documents of a sequence are paired and each pair made
even by moving one token between them (the sequence keeps its tokens; a 1-token document may
vanish). It prints per-GPU attention work max/mean two ways:

- per-GPU sums: the busiest GPU's work over the step / the mean GPU's;
- lock-step: the busiest GPU of each micro-batch, summed over micro-batches / the mean GPU's
  work (micro-batches run in lock-step);

and the same two figures for the project's `distca` on the same (unpaired) steps, from its
plan's tiles (each replica's work shared evenly by its C GPUs). Not part of the test suite: it
needs DistCA's source.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import sys
import time
import types
from copy import deepcopy
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libra_ext.planner import LayoutConfig, Planner, PlannerOptions  # noqa: E402
from libra_ext.simulator import distca_gpu  # noqa: E402
from libra_ext.workload import LengthSource, ModelConfig  # noqa: E402

NEEDED = ("Item", "batch_to_items_general", "Planner")

SCENARIOS = {  # the project's paper steps: preset, GBS, DP, CP, context
    "256k": ("libra-256k", 128, 16, 8, 262_144),
    "1m": ("libra-1m", 32, 16, 16, 1_048_576),
}


def load_distca(path: Path) -> dict:
    """DistCA's `Item`, `batch_to_items_general` and `Planner` from its planner source."""
    tree = ast.parse(path.read_text())
    keep = [n for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in NEEDED]
    missing = set(NEEDED) - {n.name for n in keep}
    if missing:
        raise SystemExit(f"{path} does not define {sorted(missing)}")
    quiet = types.SimpleNamespace(print=lambda *a, **k: None,
                                  console=types.SimpleNamespace(RenderResult=object))
    torch_names = types.SimpleNamespace(dtype=object, bfloat16=None, Tensor=object)
    ns = {"__builtins__": __builtins__, "rich": quiet, "deepcopy": deepcopy,
          "SimpleNamespace": SimpleNamespace, "Console": object, "Panel": object,
          "Table": object, "List": list, "Dict": dict, "Any": object, "Optional": object,
          "torch": torch_names, "defaultdict": collections.defaultdict, "ShardInfo": object}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), ns)
    return ns


def paired_even(seq: list[int]) -> list[int]:
    """The sequence's documents with its odd ones paired and made even (sum kept)."""
    b = list(seq)
    odd = [i for i, length in enumerate(b) if length % 2]
    for x, y in zip(odd[0::2], odd[1::2]):
        if b[y] > 1:
            b[x], b[y] = b[x] + 1, b[y] - 1
        else:
            b[x], b[y] = b[x] - 1, b[y] + 1
    return [length for length in b if length > 0]


def per_micro_batch(steps: list, D: int, balance) -> dict:
    """Per-GPU work of every micro-batch (the D sequences of a slot, in the production order)
    as `balance(batch)` gives it, and the two max/mean figures over the steps."""
    t0, rounds = time.perf_counter(), []
    for seqs in steps:
        rounds += [balance(batch) for batch in distca_gpu.slots_of(seqs, D, "megatron")]
    total = np.sum(rounds, axis=0)
    return {"per_gpu_sums": float(total.max() / total.mean()),
            "lock_step": float(sum(w.max() for w in rounds) / total.mean()),
            "seconds": time.perf_counter() - t0, "rounds": rounds}


def distca_own(ns: dict, steps: list, D: int, C: int, S: int, tolerance: float,
               model: ModelConfig) -> dict:
    mc = SimpleNamespace(hidden_size=model.heads * model.head_dim,
                         num_attention_heads=model.heads, num_key_value_heads=model.kv_heads,
                         num_hidden_layers=1)
    par = SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)

    def balance(batch):
        items = ns["batch_to_items_general"]([paired_even(s) for s in batch], S // C, D * C, mc)
        planner = ns["Planner"](D * C, par, tolerance_factor=tolerance, model_config=mc)
        work = np.zeros(D * C)
        for item in planner.plan_items(items):
            work[item.gpuid] += item.get_flops()
        return work

    return per_micro_batch(steps, D, balance)


def project_gpu(steps: list, D: int, C: int, S: int, tolerance: float, model: ModelConfig,
                prepare) -> dict:
    """The project's model of DistCA as deployed (the simulator's `distca`)."""
    return per_micro_batch(steps, D, lambda batch: distca_gpu.balance(
        [prepare(s) for s in batch], S // C, D * C, tolerance, model.heads * model.head_dim,
        model.kv_heads * model.head_dim))


def project_distca(steps: list, D: int, C: int, S: int, model: ModelConfig) -> dict:
    layout = LayoutConfig(dp=D, cp=C, pool_size=D, context=S)
    planner = Planner(layout, model, PlannerOptions(system="distca"))
    total, lock, ranks = np.zeros(D), 0.0, np.zeros((D, C))
    for seqs in steps:
        plan = planner.plan(seqs)
        ranks += plan.rank_load
        m = len(seqs) // D
        per = np.zeros((m, D))  # (slot, executor replica) work
        np.add.at(per, (plan.seq_slot[plan.tile_seq], plan.tile_executor), plan.tile_pairs)
        total += per.sum(axis=0)
        lock += per.max(axis=1).sum()
    # a replica's C GPUs share its work evenly: per-GPU ratios are the per-replica ones
    return {"per_gpu_sums": float(total.max() / total.mean()), "lock_step": float(lock / total.mean()),
            "rank_load_sums": float(ranks.max() / ranks.mean())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--distca-file", type=Path, required=True,
                    help="distca/planner/planner.py from a DistCA checkout")
    ap.add_argument("--scenarios", default="256k,1m")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", default="0.05,0.1",
                    help="DistCA tolerance factors to run (comma-separated)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ns = load_distca(args.distca_file)
    model = ModelConfig()
    out = {}
    for name in args.scenarios.split(","):
        preset, gbs, D, C, S = SCENARIOS[name]
        src = LengthSource(preset=preset)
        steps = [src.step(gbs, S, args.seed, s).tolist() for s in range(args.steps)]
        row = {"project_distca_replica": project_distca(steps, D, C, S, model)}
        for tol in (float(t) for t in args.tolerance.split(",")):
            row[f"distca_own_gpu_tol{tol:g}"] = distca_own(ns, steps, D, C, S, tol, model)
            row[f"project_gpu_tol{tol:g}"] = project_gpu(steps, D, C, S, tol, model, paired_even)
            row[f"project_gpu_tol{tol:g}_unpaired"] = project_gpu(steps, D, C, S, tol, model, list)
            own, ours = row[f"distca_own_gpu_tol{tol:g}"], row[f"project_gpu_tol{tol:g}"]
            ours["micro_batches_differing"] = sum(
                not np.array_equal(a, b) for a, b in zip(own["rounds"], ours["rounds"]))
            ours["micro_batches"] = len(own["rounds"])
        for r in row.values():
            r.pop("rounds", None)
        out[name] = row
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print("per-GPU attention work max/mean (per-GPU sums / lock-step), "
          f"{args.steps} steps, seed {args.seed}")
    for name, row in out.items():
        for who, r in row.items():
            same = (f"  ({r['micro_batches_differing']} of {r['micro_batches']} micro-batches "
                    "differ from DistCA's own)" if "micro_batches" in r else "")
            print(f"  {name:5s} {who:28s} {r['per_gpu_sums']:.4f} / {r['lock_step']:.4f}{same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
