"""The planner's attention cost model: a table of time per causal pair over attended-length bins,
per query row, per segment and per rank, fitted from measured attention times.

Without a table the planner balances causal pairs x heads. With one (`Planner.set_cost_model`)
Libra's TAP and VRSP and DistCA's greedy balance the table's predicted time instead; the exact
formula is in `cpp/include/libra/cost.h` and docs/plan_contract.md ("Work under a cost model").

A rank's work in a step is summarised by its *features* (`call_features`): over the segments of
the kernel calls it runs (a segment: q rows of one document against their causal prefix of k
keys, over the call's hc query heads), per half-octave bin of attended length the pairs x heads
of the rows attending that many keys (row i attends i + 1), then the query rows x heads, the
segment count and 1. Its predicted time is features . coefficients.

`OnlineFit` accumulates (features, measured seconds) rows - every rank's, gathered, so that every
rank holds the same rows - into fp64 normal equations and solves a non-negative least squares
pulled towards a prior (the pairs model scaled to the measurements, or a profile's table) where
the data says little; outliers (a rank that was pre-empted) are dropped by their residual. The
arithmetic is elementwise numpy and the C++ solver's plain loops, so equal rows give equal bits.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import yaml

from libra_ext import _planner as _core

BINS = int(_core.COST_BINS)
"""Half-octave bins of the attended length over [1, 2^30]."""
FEATURES = int(_core.COST_FEATURES)
"""Features of a rank's work: BINS pair counts, rows, segments, the constant."""
ROWS, SEGMENTS, CONSTANT = BINS, BINS + 1, BINS + 2
ATTN_BWD_FACTOR = 2.5
"""Backward attention FLOPs over forward (the core's kAttnBwdFactor, the simulator's)."""
COST_MODELS = ("pairs", "profile", "online")
"""What a planner balances: causal pairs; a table from a measured hardware profile (`libra
calibrate`); a table fitted online from the run's own attention times (starting from the
profile's where one is given, else from pairs)."""


def bin_of(kv_len) -> np.ndarray:
    """The bin of each attended length (the C++ core's `cost_bin`): 2 floor(log2 l) + (l >=
    sqrt(2) 2^floor(log2 l)), exact integer arithmetic."""
    scalar = np.ndim(kv_len) == 0
    kv = np.maximum(np.atleast_1d(np.asarray(kv_len, dtype=np.int64)), 1)
    e = np.zeros_like(kv)
    x = kv.copy()
    for shift in (32, 16, 8, 4, 2, 1):  # floor(log2) without floating point
        big = x >= (np.int64(1) << shift)
        e[big] += shift
        x[big] >>= shift
    half = (kv * kv >= (np.int64(1) << (2 * e + 1))).astype(np.int64)
    out = np.minimum(BINS - 1, 2 * e + half)
    return out[0] if scalar else out


def _bin_starts() -> np.ndarray:
    """The smallest attended length of each bin, and 2^30 + 1 after the last (bin 1 is empty:
    it starts where bin 2 does)."""
    out = [0] * (BINS + 1)
    out[BINS] = 2**30 + 1
    for b in range(BINS - 1, -1, -1):
        e = b // 2
        lo = 2**e if b % 2 == 0 else math.isqrt(2 ** (2 * e + 1) - 1) + 1
        out[b] = min(lo, out[b + 1])
    return np.array(out, dtype=np.int64)


BIN_STARTS = _bin_starts()


def segment_features(q_len, kv_len, heads) -> np.ndarray:
    """Features [FEATURES] of segments (arrays of query rows, attended keys and heads each; the q
    rows are the last of the k-key prefix): per bin the pairs x heads of the rows whose attended
    length (row i of the document attends i + 1 keys) falls in it, the rows x heads, the
    segments. Segments with no rows or no keys do no work and are not counted. The constant is
    0 here (a rank's rows add it once)."""
    q = np.asarray(q_len, dtype=np.int64).ravel()
    k = np.asarray(kv_len, dtype=np.int64).ravel()
    h = np.broadcast_to(np.asarray(heads, dtype=np.int64), q.shape)
    live = (q > 0) & (k > 0)
    q, k, h = q[live], k[live], h[live]
    out = np.zeros(FEATURES)
    if len(q):
        # attended lengths [k - q + 1, k] against each bin's [start, next start - 1]
        u = np.maximum((k - q + 1)[:, None], BIN_STARTS[None, :BINS])
        v = np.minimum(k[:, None], BIN_STARTS[None, 1:] - 1)
        pairs = np.where(u <= v, (u + v) * (v - u + 1) // 2, 0)
        out[:BINS] = (h[:, None].astype(np.float64) * pairs.astype(np.float64)).sum(axis=0)
        out[ROWS] = float((h * q).sum())
        out[SEGMENTS] = float(len(q))
    return out


def call_features(calls) -> np.ndarray:
    """A rank's features [FEATURES] from the kernel calls it runs in a step (each with `hc`,
    `cu_q`, `cu_k`: the operator's `CallPlan`s), the constant set to 1."""
    out = np.zeros(FEATURES)
    for c in calls:
        out += segment_features(np.diff(np.asarray(c.cu_q)), np.diff(np.asarray(c.cu_k)), c.hc)
    out[CONSTANT] = 1.0
    return out


def _number(v, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
        raise ValueError(f"{field} must be a number, got {v!r}")
    x = float(v)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{field} must be finite and >= 0, got {v!r}")
    return x


@dataclass
class CostTable:
    """Time per causal pair and head in each attended-length bin (seconds), per query row and
    head, per segment and per rank (forward + backward)."""

    per_pair: np.ndarray
    per_row: float = 0.0
    per_segment: float = 0.0
    per_rank: float = 0.0

    def __post_init__(self) -> None:
        self.per_pair = np.asarray(self.per_pair, dtype=np.float64)
        self.to_core().validate()

    def coefficients(self) -> np.ndarray:
        return np.r_[self.per_pair, self.per_row, self.per_segment, self.per_rank]

    @classmethod
    def from_coefficients(cls, x) -> "CostTable":
        x = np.asarray(x, dtype=np.float64)
        if x.shape != (FEATURES,):
            raise ValueError(f"coefficients must have shape ({FEATURES},), got {x.shape}")
        return cls(x[:BINS].copy(), float(x[ROWS]), float(x[SEGMENTS]), float(x[CONSTANT]))

    @classmethod
    def pairs(cls, per_pair: float = 1.0) -> "CostTable":
        """The pairs model as a table: the same time per pair at every length, nothing else."""
        return cls(np.full(BINS, float(per_pair)))

    def to_core(self) -> "_core.CostModel":
        out = _core.CostModel()
        out.per_pair = [float(v) for v in self.per_pair]
        out.per_row, out.per_segment, out.per_rank = (
            float(self.per_row), float(self.per_segment), float(self.per_rank))
        return out

    def predict(self, features) -> np.ndarray:
        """Predicted seconds of each row of features ([n, FEATURES] or [FEATURES])."""
        return np.asarray(features, dtype=np.float64) @ self.coefficients()

    def to_dict(self) -> dict:
        return {"per_pair": [float(v) for v in self.per_pair], "per_row": float(self.per_row),
                "per_segment": float(self.per_segment), "per_rank": float(self.per_rank)}

    @classmethod
    def from_dict(cls, d, where: str = "cost_table") -> "CostTable":
        """A table from `to_dict` (a checkpoint's: untrusted), refused naming the field."""
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be a mapping, got {type(d).__name__}")
        extra = sorted(set(d) - {"per_pair", "per_row", "per_segment", "per_rank"})
        if extra:
            raise ValueError(f"{where}: unknown keys {extra}")
        pp = d.get("per_pair")
        if not isinstance(pp, (list, tuple, np.ndarray)) or len(pp) != BINS:
            raise ValueError(f"{where}.per_pair must be a list of {BINS} numbers")
        per_pair = [_number(v, f"{where}.per_pair[{i}]") for i, v in enumerate(pp)]
        rest = {k: _number(d.get(k, 0.0), f"{where}.{k}")
                for k in ("per_row", "per_segment", "per_rank")}
        try:
            return cls(np.array(per_pair), **rest)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def from_profile(cls, profile, head_dim: int) -> "CostTable":
        """The table a hardware profile implies (`libra calibrate`'s measured curve, the
        simulator's attention model): per pair and head 4 d FLOPs forward, backward at
        kAttnBwdFactor x that at the profile's backward speed ratio, at the profile's peak times
        its efficiency at the bin's attended length. The profile's call floor is per kernel
        call - a rank makes the same calls whatever it is given - so rows, segments and ranks
        cost nothing here (an online fit learns them)."""
        centres = np.sqrt(2.0) ** (np.arange(BINS) + 0.5)
        eff = np.maximum(np.asarray(profile.attn_efficiency(centres), dtype=np.float64), 1e-6)
        flops = 4.0 * head_dim * (1.0 + ATTN_BWD_FACTOR / profile.attn_bwd_speed)
        return cls(flops / (profile.attn_peak * eff))


def load_table(source: str, profile=None, head_dim: int | None = None) -> CostTable:
    """A table from `source`: `profile` (the hardware profile's, `from_profile`), or a JSON /
    YAML file holding a table (`CostTable.to_dict`) or a `libra bench replay --json` result
    (its `online_table`)."""
    if source == "profile":
        if profile is None or head_dim is None:
            raise ValueError("cost table 'profile' needs a hardware profile and the head dim")
        return CostTable.from_profile(profile, head_dim)
    try:
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise ValueError(f"cost table {source}: cannot open ({e.strerror})") from None
    try:
        d = json.loads(text)  # (YAML 1.1 would read JSON's 4e-09 as a string)
    except json.JSONDecodeError:
        try:
            d = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"cost table {source}: neither JSON nor YAML ({e})") from None
    if isinstance(d, dict) and "online_table" in d:
        d = d["online_table"]
    return CostTable.from_dict(d, f"cost table {source}")


def error_of(predicted, measured) -> float:
    """The model's error: median over rows of |predicted - measured| / measured."""
    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    ok = m > 0
    return float(np.median(np.abs(p[ok] - m[ok]) / m[ok])) if ok.any() else 0.0


def split_error_of(predicted, measured) -> float:
    """The error of the predicted split of one step's time among ranks: `error_of` with the
    predictions scaled to the measured total. A planner balances ranks against each other, so
    this is the part of the error that costs balance; what it leaves out - the whole step
    running faster or slower than predicted (a device whose clock drifts, a shared host's load)
    - moves every rank alike."""
    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    total = float(p.sum())
    return error_of(p * (float(m.sum()) / total) if total > 0 else p, m)


class OnlineFit:
    """A cost table fitted from (features, measured seconds) rows.

    `add` takes rows (every rank's, in the same order on every rank); `fit` folds the rows added
    since the last fit into the normal equations (older ones weigh `decay` each fit, so the
    table follows a device whose speed drifts) and solves. A row whose residual under the
    current table exceeds `outlier` robust deviations (1.4826 x the median absolute residual)
    and 10% of its time is dropped. Where the data cannot tell features apart, the solution is
    pulled towards the prior with weight `alpha` (relative to each feature's own weight): the
    prior table if given (a profile's), else the pairs model scaled to the measured times."""

    def __init__(self, prior: CostTable | None = None, decay: float = 0.5, alpha: float = 1e-3,
                 outlier: float = 4.0, smooth: float = 0.01):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        self.prior, self.decay, self.alpha, self.outlier = prior, decay, alpha, outlier
        self.smooth = smooth
        self.G = np.zeros((FEATURES, FEATURES))
        self.b = np.zeros(FEATURES)
        self.table: CostTable | None = None
        self.fits = 0
        self.dropped = 0
        self._rows: list = []

    def add(self, features, seconds) -> None:
        f = np.atleast_2d(np.asarray(features, dtype=np.float64))
        t = np.atleast_1d(np.asarray(seconds, dtype=np.float64))
        if f.shape[1:] != (FEATURES,) or len(f) != len(t):
            raise ValueError(f"features must be [n, {FEATURES}] beside n times, got {f.shape} "
                             f"and {t.shape}")
        for i, (row, y) in enumerate(zip(f, t)):
            if not (np.isfinite(row).all() and (row >= 0).all() and math.isfinite(y) and y >= 0):
                raise ValueError(f"row {i}: features and seconds must be finite and >= 0")
            self._rows.append((row, float(y)))

    def _keep(self) -> list:
        if self.table is None or len(self._rows) < 4:
            return self._rows
        pred = np.array([row @ self.table.coefficients() for row, _ in self._rows])
        meas = np.array([y for _, y in self._rows])
        r = np.abs(meas - pred)
        scale = 1.4826 * float(np.median(r))
        keep = [row for row, ri, y in zip(self._rows, r, meas)
                if not (ri > self.outlier * scale and ri > 0.1 * y)]
        self.dropped += len(self._rows) - len(keep)
        return keep

    def fit(self) -> CostTable | None:
        """Fold the new rows in and solve; the new table (or the current one when there is still
        nothing to fit)."""
        rows = self._keep()
        self._rows = []
        if rows:
            self.G *= self.decay
            self.b *= self.decay
            for row, y in rows:  # elementwise: the same bits on every rank
                self.G += np.multiply.outer(row, row)
                self.b += row * y
        if not self.b[:SEGMENTS].any():
            return self.table
        x = self._solve()
        if not x[:BINS].any():  # a degenerate fit: keep the prior's shape
            x = self._prior()
        self.table = CostTable.from_coefficients(x)
        self.fits += 1
        return self.table

    def _solve(self) -> np.ndarray:
        """The bins from the shortest to the longest attended length seen, and the other
        features seen, solved together: each bin tied to its neighbours with weight `smooth`
        times the heaviest bin's own, so that a bin with little data (short lengths hold few
        pairs) follows the ones beside it while one with much data follows its data; bins
        outside the seen range take the nearest seen bin's value."""
        prior = self._prior()
        diag = np.diag(self.G)
        seen_bins = np.flatnonzero(diag[:BINS] > 0)
        if not len(seen_bins):
            return prior
        lo, hi = int(seen_bins[0]), int(seen_bins[-1])
        idx = np.r_[np.arange(lo, hi + 1), [j for j in (ROWS, SEGMENTS, CONSTANT) if diag[j] > 0]]
        G = self.G[np.ix_(idx, idx)].copy()
        b = self.b[idx].copy()
        n_bins = hi - lo + 1
        scale = float(diag[seen_bins].max())
        for i in range(n_bins - 1):  # smoothness: smooth * scale * (x_i - x_j)^2
            c = self.smooth * scale
            G[i, i] += c
            G[i + 1, i + 1] += c
            G[i, i + 1] -= c
            G[i + 1, i] -= c
        x_sub, _sweeps, _ok = _core.nnls_normal(G.ravel().tolist(), b.tolist(),
                                                prior[idx].tolist(), self.alpha)
        x = prior.copy()
        x[idx] = x_sub
        x[:lo] = x[lo]
        x[hi + 1:BINS] = x[hi]
        for j in (ROWS, SEGMENTS, CONSTANT):
            if diag[j] == 0:
                x[j] = 0.0
        return x

    def _prior(self) -> np.ndarray:
        if self.prior is not None:
            return self.prior.coefficients()
        # the pairs model scaled to the measurements: y ~ c x sum of pair features
        gp = float(self.G[:BINS, :BINS].sum())
        c = float(self.b[:BINS].sum()) / gp if gp > 0 else 1.0
        return np.r_[np.full(BINS, max(c, 0.0) or 1.0), 0.0, 0.0, 0.0]

    def state_dict(self) -> dict:
        return {"table": self.table.to_dict() if self.table is not None else None,
                "G": self.G.ravel().tolist(), "b": self.b.tolist(), "fits": self.fits}

    def load_state_dict(self, sd, where: str = "cost_fit") -> None:
        """Restore `state_dict` (a checkpoint's: refused naming the field, nothing changed)."""
        if not isinstance(sd, dict):
            raise ValueError(f"{where} must be a mapping")
        table = None if sd.get("table") is None else CostTable.from_dict(sd["table"],
                                                                           f"{where}.table")
        G = np.asarray(sd.get("G", []), dtype=np.float64)
        b = np.asarray(sd.get("b", []), dtype=np.float64)
        if G.shape != (FEATURES * FEATURES,) or b.shape != (FEATURES,):
            raise ValueError(f"{where}: G must hold {FEATURES}^2 and b {FEATURES} numbers")
        if not (np.isfinite(G).all() and np.isfinite(b).all()):
            raise ValueError(f"{where}: G and b must be finite")
        self.table, self.G, self.b = table, G.reshape(FEATURES, FEATURES), b
        self.fits = int(sd.get("fits", 0))
