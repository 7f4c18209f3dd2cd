"""Document-length distributions for balance sweeps, and the sweep behind `libra bench balance`.

Each distribution draws document lengths with numpy from a seed; a step is the stream packed
into B sequences of S tokens the way Megatron packs (sequential fill, documents split at the
boundary). The sweep plans steps of every distribution under every system and pool size and
reports per-rank attention max/mean beside the lowest value reachable with tiles kept inside
pools (`StepPlan.achievable_max_over_mean`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from libra_ext.planner import LayoutConfig, Planner, PlannerOptions
from libra_ext.workload import ModelConfig, pack_production


@dataclass(frozen=True)
class LengthDistribution:
    """A named document-length distribution (kinds: lognormal, pareto, mix, bimodal)."""

    name: str
    kind: str
    a: float
    """lognormal: median; pareto: minimum length x_m; mix: lognormal median; bimodal: short
    length."""
    b: float
    """lognormal/mix: sigma; pareto: alpha; bimodal: long length."""
    c: float = 0.0
    """mix: share of documents from a Pareto(x_m = 8192, alpha = 1.2) tail; bimodal: share of
    long documents (0 < c < 1)."""

    def draw(self, n: int, rng: np.random.Generator, cap: int) -> np.ndarray:
        if self.kind == "lognormal":
            x = self.a * np.exp(self.b * rng.standard_normal(n))
        elif self.kind == "pareto":
            x = self.a * (1.0 + rng.pareto(self.b, n))
        elif self.kind == "mix":
            body = self.a * np.exp(self.b * rng.standard_normal(n))
            tail = 8192.0 * (1.0 + rng.pareto(1.2, n))
            x = np.where(rng.random(n) < self.c, tail, body)
        elif self.kind == "bimodal":
            x = np.where(rng.random(n) < self.c, self.b, self.a)
        else:
            raise ValueError(f"kind must be lognormal, pareto, mix or bimodal, got {self.kind!r}")
        return np.clip(np.rint(x), 1, cap).astype(np.int64)

    def step(self, gbs: int, context: int, seed: int) -> list[list[int]]:
        """B packed sequences of S tokens from the stream seeded by `seed`."""
        rng = np.random.default_rng(seed)
        need, parts, total = gbs * context, [], 0
        while total < need:
            x = self.draw(8192, rng, context)
            parts.append(x)
            total += int(x.sum())
        lengths = np.concatenate(parts)
        k = int(np.searchsorted(np.cumsum(lengths), need)) + 1
        return [s.doc_lengths for s in pack_production(lengths[:k].tolist(), context, gbs)]


def distributions() -> list[LengthDistribution]:
    """The sweep's 42 distributions: lognormal sigma 0.5-2.5 at three medians (and 0.5-1.5 at a
    long median), Pareto alpha 0.8-2 at three minimum lengths, lognormal bodies with Pareto
    tails, and bimodal short/mid and short/context-length mixes."""
    out = []
    for median in (256, 1000, 4000):
        for sigma in (0.5, 1.0, 1.5, 2.0, 2.5):
            name = f"lognormal m{median} s{sigma}"
            out.append(LengthDistribution(name, "lognormal", median, sigma))
    for sigma in (0.5, 1.0, 1.5):
        out.append(LengthDistribution(f"lognormal m16000 s{sigma}", "lognormal", 16000, sigma))
    for xm in (64, 512, 2048):
        for alpha in (0.8, 1.1, 1.5, 2.0):
            out.append(LengthDistribution(f"pareto x{xm} a{alpha}", "pareto", xm, alpha))
    for median, sigma in ((644, 1.0), (300, 1.5)):
        for share in (0.005, 0.02, 0.08):
            name = f"mix m{median} s{sigma} t{share}"
            out.append(LengthDistribution(name, "mix", median, sigma, share))
    for short, long, share in (
        (16, 8191, 0.0005),
        (16, 8191, 0.005),
        (64, 32768, 0.002),
        (128, 131072, 0.001),
        (16, 262144, 0.0002),
        (512, 65536, 0.01),
    ):
        out.append(
            LengthDistribution(f"bimodal {short}/{long} p{share}", "bimodal", short, long, share)
        )
    return out


LAYOUTS = {
    # name: (context, gbs, dp, cp)
    "256k": (262_144, 128, 16, 8),
    "1m": (1_048_576, 32, 16, 16),
}


def run(
    dists=None,
    layouts=("256k", "1m"),
    pools=(2, 4, 8, 16),
    systems=("libra", "ulysses", "distca", "wlb"),
    steps: int = 2,
    seed: int = 0,
    model: ModelConfig | None = None,
    progress=None,
) -> list[dict]:
    """One row per (distribution, layout, pool size): the mean over `steps` of every system's
    per-rank max/mean and of the achievable bound (libra's plan)."""
    model = model or ModelConfig()
    rows = []
    for dist in dists or distributions():
        for lname in layouts:
            context, gbs, dp, cp = LAYOUTS[lname]
            batches = [dist.step(gbs, context, seed * 1000 + s) for s in range(steps)]
            for P in pools:
                if dp % P:
                    continue
                layout = LayoutConfig(dp=dp, cp=cp, pool_size=P, context=context)
                row = {"distribution": dist.name, "layout": lname, "pool": P}
                for system in systems:
                    planner = Planner(layout, model, PlannerOptions(system=system))
                    try:
                        plans = [planner.plan(b, flush=True) for b in batches]
                    except ValueError as e:  # e.g. over the plan's tile budget: say so
                        row[system] = None
                        row.setdefault("refused", {})[system] = str(e)
                        continue
                    row[system] = float(np.mean([p.max_over_mean for p in plans]))
                    if system == "libra":
                        row["bound"] = float(np.mean([p.achievable_max_over_mean for p in plans]))
                        row["libra_worst_gap"] = float(
                            max(p.max_over_mean - p.achievable_max_over_mean for p in plans)
                        )
                rows.append(row)
                if progress is not None:
                    progress(row)
    return rows
