"""The training app's console lines and their sinks: where they go (stdout, as Megatron-LM
prints them), the resolved config as Megatron-LM prints its arguments, Megatron-LM's iteration
line with Libra's fields, and the model FLOPs behind its TFLOP/s. Torch-free."""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time

from libra_ext.workload import LINEAR_BWD_FACTOR, linear_fwd_flops_per_token

logger = logging.getLogger("libra.train")

LAUNCH_ENV = "LIBRA_LAUNCH_TIME"
"""Set by the local launcher (`--nproc`): when it started, so workers can say how long
start-up took."""


PROGRESS_ENV = "LIBRA_PROGRESS_STREAM"
"""stderr: the run's lines go to stderr (set by `libra ab --json`, whose stdout is the JSON)."""


def progress_stream():
    """Where the run's lines go: stdout, as Megatron-LM prints them, unless PROGRESS_ENV says
    stderr."""
    return sys.stderr if os.environ.get(PROGRESS_ENV) == "stderr" else sys.stdout


def since_launch() -> str:
    """'N.N s after launch' (the local launcher's start, else this process's)."""
    start = os.environ.get(LAUNCH_ENV)
    if start is None:
        try:
            # optional: the process's start time
            import psutil

            start = psutil.Process().create_time()
        except Exception:  # no psutil: say nothing about when
            return ""
    return f"{time.time() - float(start):.1f} s after launch"


def config_lines(cfg) -> list[str]:
    """The resolved config one key per line, as Megatron-LM prints its arguments."""
    flat = {}
    for section, value in cfg.to_dict().items():
        if isinstance(value, dict):
            flat.update({f"{section}.{k}": v for k, v in value.items()})
        else:
            flat[section] = value
    lines = ["------------------------ libra train: config ------------------------"]
    for key in sorted(flat):
        lines.append(f"  {key} {'.' * max(48 - len(key), 2)} {json.dumps(flat[key])}")
    lines.append("-------------------- libra train: end of config --------------------")
    return lines


def progress_log() -> None:
    """Iteration lines on stdout as Megatron prints them (message only), under torchrun, Slurm
    or `--nproc` alike; errors stay on stderr; `libra --log-level` still governs everything
    else."""
    if not any(getattr(h, "_libra_progress", False) for h in logger.handlers):
        handler = logging.StreamHandler(progress_stream())
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._libra_progress = True
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False




def step_flops(model, tokens: float, plan, tp: int) -> float:
    """Forward + backward FLOPs of one step from the cost model: the linear layers and LM head
    per token, and the attention pairs the plan executes (every layer, every head)."""
    linear = linear_fwd_flops_per_token(model) * model.layers + 2.0 * model.hidden * model.vocab
    # rank_load: one layer's attention FLOPs (forward + backward) of each rank's head slice
    attention = float(plan.rank_load.sum()) * tp * model.layers
    return linear * tokens * (1.0 + LINEAR_BWD_FACTOR) + attention


def log_line(window: list, total: int, gbs: int, world: int) -> str:
    """Megatron-LM's iteration line (averages over the log interval) and Libra's fields."""
    rec, n = window[-1], len(window)
    loss = sum(w["loss"] for w in window) / n
    attn = [w["attn_time_max_over_mean"] for w in window if w["attn_time_max_over_mean"]]
    nan = sum(1 for w in window if w["loss"] != w["loss"])
    cost = ""
    for key, words in (("attn_kernel_time_max_over_mean", "attn kernel time max/mean"),
                       ("attn_time_predicted_max_over_mean", "attn predicted max/mean"),
                       ("cost_model_error", "cost model error")):
        xs = [w[key] for w in window if w.get(key) is not None]
        if xs:
            cost += f"{words}: {sum(xs) / len(xs):.3f} | "
    return (
        f" [{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}] iteration {rec['step']:8d}/"
        f"{total:8d} | consumed samples: {rec['step'] * gbs:12d} | elapsed time per iteration "
        f"(ms): {1e3 * sum(w['step_time'] for w in window) / n:.1f} | throughput per GPU "
        f"(TFLOP/s/GPU): {sum(w['tflops_per_gpu'] for w in window) / n:.3f} | learning rate: "
        f"{rec['lr']:.6E} | global batch size: {gbs:5d} | lm loss: {loss:.6E} | grad norm: "
        f"{rec['grad_norm']:.3f} | number of skipped iterations: "
        f"{sum(1 for w in window if w['skipped']):3d} | number of nan iterations: {nan:3d} | "
        f"attn work max/mean: {sum(w['attn_work_max_over_mean'] for w in window) / n:.3f} | "
        f"attn time max/mean: {f'{sum(attn) / len(attn):.3f}' if attn else 'off'} | "
        f"{cost}"
        f"inter-pool imbalance: {rec['inter_pool_imbalance']:.3f} | "
        f"exchange MB/rank: {sum(w['bytes_exchanged'] for w in window) / n / world / 1e6:.2f} | "
        f"tokens/s: {sum(w['tokens'] for w in window) / sum(w['step_time'] for w in window):.1f} |"
    )
