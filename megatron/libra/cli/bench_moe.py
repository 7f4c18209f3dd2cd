"""`libra bench moe`: expert-load balancing of MoE layers on synthetic or recorded routing."""

from __future__ import annotations

import numpy as np

from libra_ext import moe
from megatron.libra.cli.args import list_arg


def add_parser(bsub) -> None:
    m = bsub.add_parser(
        "moe",
        help="MoE expert-load balancing: per-layer EP-rank load before and after replication",
        description="Plan hot-expert replication per MoE layer from the lookahead prediction "
        "(layer l+1's router on layer l's input) and measure it on the actual routing: "
        "per-layer EP-rank expert-token max/mean before and after, bytes of weights moved, plan "
        "time, and the lookahead's accuracy. Without --routing it runs synthetic routing "
        "(Zipf-skewed popularity with a drifting hot set).",
    )
    m.add_argument("--routing", help="routing record (.npz) written by `libra train` with "
                   "logging.record_routing=true")
    m.add_argument("--experts", type=int, help="routed experts (default 128; a record's own)")
    m.add_argument("--topk", type=int, help="experts per token (default 8; a record's own)")
    m.add_argument("--ep", type=int, help="expert-parallel ranks (default 8; a record's own)")
    m.add_argument("--slots", default="2",
                   help="comma-separated extra expert slots per rank (N) (default 2)")
    m.add_argument("--local-slots", type=int, default=-1,
                   help="slots phase 1 (locality) may use (default -1: N / 4)")
    m.add_argument("--zipf", default="1.2", help="comma-separated Zipf exponents (synthetic)")
    m.add_argument("--layers", type=int, default=8, help="MoE layers (synthetic)")
    m.add_argument("--tokens", type=int, default=4096, help="tokens per EP rank (synthetic)")
    m.add_argument("--hidden", type=int, default=2048,
                   help="model width, for expert bytes (default Qwen3-30B-A3B's)")
    m.add_argument("--moe-ffn", type=int, default=768, help="expert intermediate size")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=run_bench_moe)


def run_bench_moe(args) -> dict | None:
    slots = list_arg(args.slots, "slots", int, 0)
    cases = []
    if args.routing:
        rec = moe.load_routing(args.routing, args.experts, args.ep, args.topk)
        ebytes = moe.expert_bytes(rec.hidden, rec.moe_ffn)
        act = [rec.counts(layer) for layer in range(len(rec.topk_ids))]
        pred = [rec.counts(layer, predicted=True) if has else a
                for layer, (has, a) in enumerate(zip(rec.has_prediction, act))]
        overlaps = [moe.topk_overlap(p, a) if has else 1.0
                    for p, a, has in zip(rec.predicted_ids, rec.topk_ids, rec.has_prediction)]
        for n in slots:
            r = moe.bench_layers(act, pred, n, args.local_slots, ebytes, overlaps)
            r["lookahead_topk_overlap"] = (
                float(np.mean([o for o, h in zip(overlaps, rec.has_prediction) if h]))
                if rec.has_prediction.any() else None
            )
            cases.append({"source": f"file:{args.routing}", "experts": rec.experts,
                          "topk": rec.topk, "ep": rec.ep, **r})
    else:
        experts, topk, ep = args.experts or 128, args.topk or 8, args.ep or 8
        ebytes = moe.expert_bytes(args.hidden, args.moe_ffn)
        for s in list_arg(args.zipf, "zipf", float, 0.0):
            sr = moe.SyntheticRouting(experts=experts, topk=topk, ep=ep, layers=args.layers,
                                      tokens=args.tokens, zipf_s=s, seed=args.seed)
            act = [sr.counts(layer) for layer in range(sr.layers)]
            pred = [sr.counts(layer, predicted=True) for layer in range(sr.layers)]
            overlaps = [sr.topk_overlap(layer) for layer in range(sr.layers)]
            for n in slots:
                r = moe.bench_layers(act, pred, n, args.local_slots, ebytes, overlaps)
                cases.append({"source": f"synthetic zipf s={s}", "zipf_s": s,
                              "experts": experts, "topk": topk, "ep": ep, **r})
    out = {k: v for k, v in cases[0].items() if k != "rows"}
    out["cases"] = cases
    if args.json:
        return out
    print("libra bench moe: EP-rank expert-token max/mean per MoE layer, plans from the "
          "lookahead prediction measured on the actual routing")
    print(f"  {'routing':26s} {'N':>3s} {'before':>8s} {'after':>8s} {'(exact)':>8s} "
          f"{'MiB/layer':>10s} {'plan ms':>8s} {'top-k overlap':>14s} {'load err':>9s}")
    for c in cases:
        ov = c["lookahead_topk_overlap"]
        print(f"  {c['source'][:26]:26s} {c['replica_slots']:3d} "
              f"{c['max_over_mean_before']:8.3f} {c['max_over_mean_after']:8.3f} "
              f"{c['max_over_mean_after_exact']:8.3f} {c['bytes_moved_per_layer'] / 2**20:10.3f} "
              f"{c['plan_ms_per_layer']:8.3f} {'-' if ov is None else f'{ov:.3f}':>14s} "
              f"{c['lookahead_load_error']:9.3f}")
    print("  (exact: the plan made from the actual routing, the bound a perfect prediction "
          "gives)")
    return None
