"""`libra train` and `libra ab`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from libra_ext.planner import system_label
from megatron.libra.config import TrainConfig
from megatron.libra.logs import PROGRESS_ENV

LOSS_ROUNDING = 1e-5
"""Relative loss difference an A/B reads as rounding: placing a tile elsewhere changes the
order of floating-point sums, not what is computed."""


def add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="pretrain on megatron-core with Libra or a baseline",
        description="Train with the YAML config; `key.sub=value` overrides. "
        "torchrun / Slurm set the ranks; on a CPU machine --nproc N launches N gloo "
        "workers itself. Every config key, its default and meaning: docs/config_reference.md.",
    )
    p.add_argument("--config", required=True, help="training config YAML")
    p.add_argument("--nproc", type=int, help="launch this many local worker processes")
    p.add_argument("overrides", nargs="*", help="key.sub=value")
    p.set_defaults(func=run_train)


def _world(args) -> int:
    if args.nproc is not None:
        if args.nproc <= 0:
            raise ValueError(f"nproc must be positive, got {args.nproc}")
        return args.nproc
    return int(os.environ.get("WORLD_SIZE", 1))


def run_train(args):
    cfg = TrainConfig.load(args.config, args.overrides)
    world = _world(args)
    cfg.validate(world)  # before any process group exists
    if cfg.data.source == "indexed":  # damaged files, ids beyond the vocabulary, empty splits
        # deferred: megatron-core, once its notices are quiet
        from megatron.libra.sources import check_data

        check_data(cfg)
    ck = cfg.checkpoint
    if ck.dir or ck.load_dir:  # damaged, another model, changed settings, overwrites: refused
        # deferred: megatron-core, once its notices are quiet
        from megatron.libra.checkpoint import check_writable, load_plan

        src = load_plan(ck, cfg.model.weight_fields(), cfg.resume_fields())
        if src is not None and not src.finetune and src.step >= cfg.schedule.train_steps:
            decay = src.saved_decay_steps()
            print(
                f"libra train: nothing to do: {src.path} is at step {src.step} and "
                f"schedule.train_steps is {cfg.schedule.train_steps}; to train further, raise "
                "schedule.train_steps and keep the saved learning-rate schedule with "
                f"schedule.decay_steps={decay if decay is not None else src.step} (the rate "
                "stays at optimizer.min_lr past it), or let the schedule follow the new length "
                "with checkpoint.override_scheduler=true"
            )
            return None
        if ck.dir:
            check_writable(ck.dir, cfg)
    _cli_launch(cfg, world, args.nproc)
    return None


def _cli_launch(cfg: TrainConfig, world: int, nproc: int | None) -> list[dict]:
    """launch() for the command line: a failed worker was reported in one line; exit 1."""
    # deferred: the CLI starts without torch
    from torch.multiprocessing.spawn import ProcessException

    from megatron.libra.launch import launch

    try:
        return launch(cfg, world, nproc)
    except ProcessException:
        raise SystemExit(1) from None


def add_ab_parser(sub) -> None:
    p = sub.add_parser(
        "ab",
        help="A/B runs of the same data under several systems",
        description="Train the same config, data and initialisation under each "
        "system and report losses, per-rank attention work and time, tokens/s.",
    )
    p.add_argument("--config", required=True,
                   help="a `libra train` config; with --trainer megatron, a --yaml-cfg file of "
                   "pretrain_gpt_libra.py")
    p.add_argument("--trainer", choices=("libra", "megatron"), default="libra",
                   help="libra: `libra train`'s loop; megatron: Megatron-LM's own loop "
                   "(pretrain_gpt_libra.py under torchrun with --nproc processes, megatron-core "
                   ">= 0.19), its arguments from --config and those after `--`")
    p.add_argument("--systems", default="libra,ulysses", help="comma-separated systems")
    p.add_argument(
        "--moe-balancers",
        help="comma-separated moe.balancer values (e.g. none,libra): A/B the MoE expert "
        "balancer under the config's system instead of the systems",
    )
    p.add_argument(
        "--cost-models",
        help="comma-separated system.cost_model values (e.g. pairs,online): A/B what the "
        "config's system balances instead of the systems",
    )
    p.add_argument("--steps", type=int, default=10, help="schedule.train_steps of every run")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per system, interleaved (A B A B ...); speed figures are the "
                   "medians over them, with their range")
    p.add_argument("--nproc", type=int, help="local worker processes (CPU / gloo)")
    p.add_argument("--out", default="out/ab", help="report directory")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*",
                   help="key.sub=value; with --trainer megatron, pretrain_gpt_libra.py's own "
                   "arguments after `--` (they win over --config's)")
    p.set_defaults(func=run_ab)


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


def _spread(xs: list[float]) -> dict:
    """Median and range of one figure over the repeats."""
    return {"median": _median(xs), "min": min(xs), "max": max(xs), "runs": list(xs)}


def _run_figures(hist: list[dict]) -> dict:
    """One run's speed figures: tokens/s over its steps after the first (allocation and
    first-call warm-up), its mean attention time max/mean and, where its steps measured it
    (logging.attention_time), its mean kernel time max/mean."""
    timed = hist[1:] or hist
    kernel = [h.get("attn_kernel_time_max_over_mean") for h in hist]
    kernel = [x for x in kernel if x is not None]
    return {
        "tokens_per_s": sum(h["tokens"] for h in timed) / max(sum(h["step_time"] for h in timed),
                                                              1e-12),
        "attn_time_max_over_mean": sum(h["attn_time_max_over_mean"] for h in hist) / len(hist),
        "attn_kernel_time_max_over_mean": sum(kernel) / len(kernel) if kernel else None,
    }


def run_ab(args):
    before = os.environ.get(PROGRESS_ENV)
    if args.json:  # stdout is the JSON: the runs' own lines go to stderr
        os.environ[PROGRESS_ENV] = "stderr"
    try:
        return _run_ab(args)
    finally:
        if before is None:
            os.environ.pop(PROGRESS_ENV, None)
        else:
            os.environ[PROGRESS_ENV] = before


def _run_ab(args):
    systems = [s for s in args.systems.split(",") if s]
    if not systems:
        raise ValueError("systems: give at least one system")
    if args.steps <= 0:
        raise ValueError(f"steps must be positive, got {args.steps}")
    if args.repeats <= 0:
        raise ValueError(f"repeats must be positive, got {args.repeats}")
    if args.trainer == "megatron":
        return _megatron_ab(args, systems)
    base = TrainConfig.load(args.config, args.overrides)
    world = _world(args)
    # (label, system, moe balancer, cost model) of every run
    if args.moe_balancers and args.cost_models:
        raise ValueError("--moe-balancers and --cost-models: A/B one of them at a time")
    if args.moe_balancers:
        runs = [(f"moe.balancer={b}", base.system.name, b, base.system.cost_model)
                for b in args.moe_balancers.split(",") if b]
        ref_name = runs[0][0]
    elif args.cost_models:
        runs = [(f"system.cost_model={m}", base.system.name, base.moe.balancer, m)
                for m in args.cost_models.split(",") if m]
        ref_name = runs[0][0]
    else:
        runs = [(name, name, base.moe.balancer, base.system.cost_model) for name in systems]
        ref_name = "ulysses"
    configs = {}
    for name, system, balancer, cost_model in runs:
        cfg = dataclasses.replace(
            base,
            system=dataclasses.replace(base.system, name=system, cost_model=cost_model),
            moe=dataclasses.replace(base.moe, balancer=balancer),
            # --steps is schedule.train_steps; the rest of the schedule is the config's, checked
            # as `libra train` checks it
            schedule=dataclasses.replace(base.schedule, train_steps=args.steps),
            checkpoint=dataclasses.replace(base.checkpoint, dir=None),
            logging=dataclasses.replace(base.logging, attention_time=True),  # it is reported
        )
        try:
            cfg.validate(world)  # every system's config before any process group exists
        except ValueError as e:
            if "schedule." in str(e):
                raise ValueError(f"{e} (--steps {args.steps} sets schedule.train_steps)") from None
            raise
        configs[name] = cfg
    device = "cuda" if _cuda() else "cpu"
    result = {
        "config": args.config,
        "overrides": list(args.overrides),
        "steps": args.steps,
        "repeats": args.repeats,
        "order": "interleaved: every system once per repeat, in turn",
        "world_size": world,
        "device": device,
        "speed_meaningful": device == "cuda",
        "distca_server": base.system.distca_server,
        "systems": {},
    }
    first, identical, figures = _interleaved(
        args.repeats, list(configs), lambda name: _cli_launch(configs[name], world, args.nproc))
    for name, cfg in configs.items():
        hist = first[name]
        entry = _entry(hist, identical[name], figures[name])
        if cfg.moe.balancer == "libra":
            for key in ("expert_tokens_max_over_mean_before",
                        "expert_tokens_max_over_mean_after", "lookahead_topk_overlap",
                        "moe_layers"):
                entry[key] = [h.get(key) for h in hist]
        result["systems"][name] = entry
    # deferred: the CLI starts without torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:  # under torchrun: rank 0 reports
        return None
    return _ab_report(args, result, figures, ref_name)


def _entry(hist: list[dict], spread: float, figures: list[dict]) -> dict:
    """One system's part of an A/B result: its first run's curves, whether its repeats gave the
    same losses (and else how far apart they are), and its speed figures over the repeats."""
    return {
        "loss": [h["loss"] for h in hist],
        "losses_identical_over_repeats": spread == 0.0,
        "max_rel_loss_diff_over_repeats": spread,
        "attn_work_max_over_mean": [h["attn_work_max_over_mean"] for h in hist],
        "attn_time_max_over_mean": [h["attn_time_max_over_mean"] for h in hist],
        "attn_time_per_rank": [h["attn_time_per_rank"] for h in hist],
        "tokens": [h["tokens"] for h in hist],
        "bytes_exchanged": [h["bytes_exchanged"] for h in hist],
        "grad_norm": [h["grad_norm"] for h in hist],
        # planned with a cost table (system.cost_model profile / online): its prediction
        "attn_time_predicted_max_over_mean": [h.get("attn_time_predicted_max_over_mean")
                                              for h in hist],
        "cost_model_error": [h.get("cost_model_error") for h in hist],
        # each rank's own kernel time (no collective waits), with logging.attention_time
        "attn_kernel_time_max_over_mean": [h.get("attn_kernel_time_max_over_mean")
                                           for h in hist],
        "tokens_per_s": _median([f["tokens_per_s"] for f in figures]),
        "repeats": {key: _spread([f[key] for f in figures])
                    for key in ("tokens_per_s", "attn_time_max_over_mean",
                                "attn_kernel_time_max_over_mean")
                    if all(f.get(key) is not None for f in figures)},
    }


def _megatron_ab(args, systems: list[str]):
    """`libra ab --trainer megatron`: each system through Megatron-LM's own loop
    (pretrain_gpt_libra.py under torchrun, --nproc local processes), interleaved; the curves
    from its --libra-metrics-file and the grad norm from Megatron-LM's iteration line; the same
    report and figures as `libra ab`."""

    if args.cost_models:
        raise ValueError("--cost-models: the cost-model A/B runs through libra train "
                         "(--trainer libra)")
    if args.moe_balancers:
        raise ValueError("--moe-balancers: the MoE balancer A/B runs through libra train "
                         "(--trainer libra)")
    if args.nproc is None or args.nproc <= 0:
        raise ValueError("--trainer megatron launches pretrain_gpt_libra.py under torchrun on "
                         "this machine: give --nproc (its processes)")
    if not Path(args.config).is_file():
        raise ValueError(f"--config {args.config}: no such file (a --yaml-cfg file of "
                         "pretrain_gpt_libra.py)")
    # deferred: the CLI starts without torch
    from megatron.libra.megatron_lm.yaml_cfg import expand_yaml_cfg

    extra = list(args.overrides)
    for flag in ("--libra-system", "--train-iters", "--libra-metrics-file", "--log-interval"):
        if _gives(extra, flag):
            raise ValueError(f"{flag}: libra ab sets it for every run (--systems, --steps)")
    # the file's arguments, then the command line's (they win); checked by Megatron-LM's parser
    given, _ = expand_yaml_cfg(["--yaml-cfg", args.config, *extra])
    # a checkpoint directory of the file's or the command line's is left alone: emptied
    no_ckpt = [x for flag in ("--save", "--load") if _gives(given, flag) for x in (flag, "")]
    server = "replica"
    for i, a in enumerate(given[:-1]):
        if a == "--libra-distca-server":
            server = given[i + 1]
    device = "cuda" if _cuda() else "cpu"
    result = {
        "config": args.config,
        "overrides": extra,
        "trainer": "megatron",
        "steps": args.steps,
        "repeats": args.repeats,
        "order": "interleaved: every system once per repeat, in turn",
        "world_size": args.nproc,
        "device": device,
        "speed_meaningful": device == "cuda",
        "distca_server": server,
        "systems": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        def run(name: str) -> list[dict]:
            return _megatron_run(args.config, [*extra, *no_ckpt], name, args.steps, args.nproc,
                                 Path(tmp))

        first, identical, figures = _interleaved(args.repeats, systems, run)
    for name in systems:
        result["systems"][name] = _entry(first[name], identical[name], figures[name])
    return _ab_report(args, result, figures, "ulysses")


MEGATRON_LINE = (r"\] iteration +(\d+)/ *\d+ \|.*?grad norm: ([0-9.eE+-]+|nan|inf)")
"""Megatron-LM's iteration line: the iteration and its grad norm."""


def _gives(argv: list[str], flag: str) -> bool:
    """Whether command-line arguments `argv` give option `flag` (`--x V` or `--x=V`)."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _megatron_run(config: str, extra: list[str], system: str, steps: int, nproc: int,
                  tmp: Path) -> list[dict]:
    """One run of pretrain_gpt_libra.py under torchrun: its per-iteration records (the metrics
    file, with Megatron-LM's grad norm added). Its output goes to stderr as it comes; a failed
    run exits 1 after its error line."""

    # deferred: the CLI starts without torch
    from libra_ext.distributed import free_port

    root = Path(__file__).resolve().parents[3]
    metrics = tmp / f"{system}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), str(root / "pretrain_gpt_libra.py"),
           "--yaml-cfg", config, *extra, "--libra-system", system, "--train-iters", str(steps),
           "--log-interval", "1", "--libra-metrics-file", str(metrics)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(root), env.get("PYTHONPATH")) if x)
    grad: dict[int, float] = {}
    tail: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as proc:
        for line in proc.stdout:
            sys.stderr.write(line)
            tail = (tail + [line.rstrip()])[-40:]
            m = re.search(MEGATRON_LINE, line)
            if m:
                grad[int(m.group(1))] = float(m.group(2))
    if proc.returncode != 0:
        why = next((x for x in reversed(tail) if "pretrain_gpt_libra.py: error:" in x),
                   next((x for x in reversed(tail) if "Error" in x), tail[-1] if tail else ""))
        print(f"libra ab: the {system} run of pretrain_gpt_libra.py failed (exit "
              f"{proc.returncode}): {why.strip()}", file=sys.stderr)
        raise SystemExit(1)
    hist = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    if [h["step"] for h in hist] != list(range(1, steps + 1)):
        raise RuntimeError(f"{metrics}: expected iterations 1..{steps}, got "
                           f"{[h['step'] for h in hist]}")
    for h in hist:
        h["grad_norm"] = grad.get(h["step"], float("nan"))
    return hist


def _interleaved(repeats: int, names: list[str], run) -> tuple[dict, dict, dict]:
    """Every run of an A/B, interleaved (A B A B ...: host load falls on every system alike):
    each name's first history (its curves), the largest relative difference of its later
    repeats' losses from its first's (0: the same bits), and each run's speed figures."""
    first: dict[str, list[dict]] = {}
    spread = {name: 0.0 for name in names}
    figures: dict[str, list[dict]] = {name: [] for name in names}
    total, k = repeats * len(names), 0
    for rep in range(repeats):
        for name in names:
            k += 1
            print(f"[ab {k}/{total}: {name}, repeat {rep + 1}/{repeats}]", file=sys.stderr)
            hist = run(name)
            figures[name].append(_run_figures(hist))
            if name not in first:
                first[name] = hist
            else:
                spread[name] = max(spread[name], _max_rel_diff(
                    [h["loss"] for h in hist], [h["loss"] for h in first[name]]))
    return first, spread, figures


def _same_over_repeats(spread: float) -> str:
    """The report's cell for whether a system's repeats trained alike, from the largest relative
    difference of their losses: yes (0: the same bits), `to X` (at rounding: where a plan
    follows measured times, system.cost_model online) or NO (X)."""
    if spread == 0.0:
        return "yes"
    return f"to {spread:.1e}" if spread <= LOSS_ROUNDING else f"NO ({spread:.1e})"


def _max_rel_diff(a: list, b: list) -> float:
    """The largest |a - b| / |b| over the steps of two loss curves (inf where their lengths or
    their non-finite values differ)."""
    if len(a) != len(b):
        return math.inf
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x == y or (math.isnan(x) and math.isnan(y)):
            continue
        if not (math.isfinite(x) and math.isfinite(y)):
            return math.inf
        worst = max(worst, abs(x - y) / max(abs(y), 1e-30))
    return worst


def _ab_report(args, result: dict, figures: dict, ref_name: str):
    """The reference comparisons, ab.json, report.md and the figures of an A/B."""
    ref = result["systems"].get(ref_name)
    result["reference"] = ref_name
    if ref:
        for name, r in result["systems"].items():
            r[f"max_rel_loss_diff_vs_{ref_name}"] = _max_rel_diff(r["loss"], ref["loss"])
            r[f"max_rel_grad_norm_diff_vs_{ref_name}"] = _max_rel_diff(r["grad_norm"],
                                                                        ref["grad_norm"])
            # the same repeat's runs ran back to back: their ratio is the paired figure
            ratios = [a["tokens_per_s"] / b["tokens_per_s"]
                      for a, b in zip(figures[name], figures[ref_name])]
            r[f"tokens_per_s_ratio_vs_{ref_name}"] = _spread(ratios)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text(_ab_markdown(result))
    _ab_figures(result, out)
    if args.json:
        return result
    print((out / "report.md").read_text())
    return None


def _cuda() -> bool:
    # deferred: the CLI starts without torch
    import torch

    return torch.cuda.is_available()


def _fmt_spread(x: dict, digits: int = 3) -> str:
    return f"{x['median']:.{digits}f} ({x['min']:.{digits}f}–{x['max']:.{digits}f})"


def _ab_markdown(r: dict) -> str:
    ref = r.get("reference", "ulysses")
    speed_note = (
        "" if r.get("speed_meaningful") else
        " **Speed figures on CPU are not meaningful**: gloo processes on a shared host time the "
        "host's load as much as the systems; they show that the runs work, not how fast the "
        "systems are on GPUs (`libra simulate` and `libra bench replay` on a GPU answer that)."
    )
    over = r.get("overrides") or []
    loop = ("Megatron-LM's own loop (`pretrain_gpt_libra.py`; arguments after the config: "
            + (" ".join(f"`{o}`" for o in over) or "none") + ")"
            if r.get("trainer") == "megatron" else "`libra train`")
    lines = [
        f"# A/B: {', '.join(r['systems'])}",
        "",
        f"Trainer: {loop}.",
        "",
        f"Config `{r['config']}`, {r['steps']} steps, {r['world_size']} ranks, "
        f"{r['device']}; same data and initialisation for every system. "
        f"{r['repeats']} repeat(s), {r['order']}.",
        "",
        *(["Overrides: " + (", ".join(f"`{o}`" for o in over) if over else "none") + ".", ""]
          if r.get("trainer") != "megatron" else []),
        f"| run | final loss | max rel. loss diff vs {ref} | max rel. grad-norm diff "
        "| losses same over repeats | attn work max/mean (mean) | per-step attn time max/mean: "
        "median (range) | per-step attn kernel time max/mean: median (range) "
        f"| expert tokens max/mean before → after (mean) | tokens/s: median (range) "
        f"| tokens/s ÷ {ref}: median (range) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in r["systems"].items():
        n = len(s["loss"])
        diff = s.get(f"max_rel_loss_diff_vs_{ref}", float("nan"))
        gdiff = s.get(f"max_rel_grad_norm_diff_vs_{ref}", float("nan"))
        moe = "-"
        if s.get("expert_tokens_max_over_mean_before"):
            b, a = s["expert_tokens_max_over_mean_before"], s["expert_tokens_max_over_mean_after"]
            moe = f"{sum(b) / len(b):.3f} → {sum(a) / len(a):.3f}"
        ratio = s.get(f"tokens_per_s_ratio_vs_{ref}")
        rep = s["repeats"]
        kernel = rep.get("attn_kernel_time_max_over_mean")
        lines.append(
            f"| {system_label(name, r.get('distca_server', 'replica'))} | {s['loss'][-1]:.5f} "
            f"| {diff:.2e} | {gdiff:.2e} "
            f"| {_same_over_repeats(s['max_rel_loss_diff_over_repeats'])} "
            f"| {sum(s['attn_work_max_over_mean']) / n:.3f} "
            f"| {_fmt_spread(rep['attn_time_max_over_mean'])} "
            f"| {_fmt_spread(kernel) if kernel else '-'} | {moe} "
            f"| {_fmt_spread(rep['tokens_per_s'], 1)} "
            f"| {_fmt_spread(ratio, 2) if ratio else '-'} |"
        )
    lines += [
        "",
        "Attention work is the plan's modeled per-rank attention FLOPs (the same in every "
        "repeat); attention time is the measured wall time of core attention per rank, forward "
        "and backward, max over mean per step, averaged over the steps of a run (it includes "
        "the collectives' waits, which follow the slowest rank, so it stays near 1 whatever the "
        "balance); attention kernel time is each rank's own attention work without those waits "
        "(`logging.attention_time`), what balancing moves; tokens/s "
        "counts the steps after the first. Medians and ranges are over the repeats; the ratio "
        f"to {ref} pairs the runs of one repeat, which ran back to back. `wlb` changes which "
        "documents each step trains on (workload-aware packing and its delay queue), so its "
        "losses differ from the others by design; placement alone (libra, distca) must not "
        "change them. A plan that follows measured times (`system.cost_model=online`) places "
        "tiles differently from repeat to repeat, so its repeats' losses agree to rounding "
        f"(`to X`: within {LOSS_ROUNDING:g} relative), not bit for bit." + speed_note,
        "",
        "![loss](loss.png)",
        "![attention time](attention_time.png)",
        "![tokens/s](tokens_per_s.png)",
        "",
    ]
    return "\n".join(lines)


def _ab_figures(r: dict, out: Path) -> None:
    # optional: matplotlib draws the figures
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = list(r["systems"])
    cpu = "" if r.get("speed_meaningful") else " (CPU: not meaningful)"
    fig, ax = plt.subplots(figsize=(6.5, 4))
    losses = [s["loss"] for s in r["systems"].values()]
    markers = ("o", "s", "^", "x", "D", "v", "+", "*")
    for i, (name, s) in enumerate(r["systems"].items()):
        steps = range(1, len(s["loss"]) + 1)
        # markers of shrinking size and styles per system: coinciding curves stay visible
        ax.plot(steps, s["loss"], ("-", "--", ":", "-.")[i % 4], marker=markers[i % 8],
                markersize=max(9 - 2 * i, 3), fillstyle="none", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("lm loss (per token, global batch)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    spread = max(max(abs(a - b) for a, b in zip(x, losses[0])) for x in losses)
    same = spread <= 1e-4 * max(abs(v) for v in losses[0])
    ax.set_title("training loss per step" + (" (curves coincide: placement does not change "
                                             "the loss)" if same and len(names) > 1 else ""),
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(len(names), 1, figsize=(6.5, 1.7 * len(names) + 1.2), sharey=True,
                             sharex=True)
    axes = [axes] if len(names) == 1 else axes
    for ax, name in zip(axes, names):
        per_rank = r["systems"][name]["attn_time_per_rank"]
        mean = [sum(x[i] for x in per_rank) / len(per_rank) for i in range(len(per_rank[0]))]
        avg = sum(mean) / len(mean)
        ax.bar(range(len(mean)), mean, color="tab:blue")
        ax.axhline(avg, color="tab:red", linestyle="--", linewidth=1)
        top = max(range(len(mean)), key=mean.__getitem__)
        ax.annotate(f"slowest rank / mean {max(mean) / max(avg, 1e-12):.3f}", (top, mean[top]),
                    textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
        ax.set_ylabel(name, rotation=0, ha="right", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel("rank")
    fig.suptitle("core-attention seconds per rank and step (forward + backward)\nmean over "
                 f"the first repeat's steps; dashed: mean over ranks{cpu}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "attention_time.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    reps = [r["systems"][n]["repeats"]["tokens_per_s"] for n in names]
    med = [x["median"] for x in reps]
    err = [[m - x["min"] for m, x in zip(med, reps)], [x["max"] - m for m, x in zip(med, reps)]]
    ax.bar(names, med, yerr=err, capsize=4, color="tab:green")
    ax.set_ylabel("tokens/s (median; bars: range)")
    ax.set_title(f"throughput over {r['repeats']} interleaved repeat(s){cpu}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s.png", dpi=110)
    plt.close(fig)
