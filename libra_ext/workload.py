"""Workload description and cost model (DESIGN.md section 4), mirrored from the C++ core.

The pure formulas (pairs, FLOPs) are written out here so that Python callers and the tests can
check the C++ core against them; generators and packing call into ``libra_ext._planner`` so that
the same seed gives the same documents in both languages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from libra_ext import _planner as _core

ATTN_BWD_FACTOR = 2.5
"""Attention backward FLOPs per forward FLOP."""
LINEAR_BWD_FACTOR = 2.0
"""Linear-layer backward FLOPs per forward FLOP."""
MAX_TOKENS = int(_core.MAX_TOKENS)
"""Largest document or packed-sequence length the core accepts (2^30)."""

SAMPLE_SHUFFLE_WINDOW = 8
"""Default steps per sample-shuffle window of `LengthSource` (Megatron's GPTDataset shuffle)."""

PRESET_CONTEXT = {
    "libra-256k": 262_144,
    "libra-1m": 1_048_576,
    "libra-256k-v1": 262_144,
    "libra-1m-v1": 1_048_576,
}
"""Default packed-sequence length of each workload preset."""


_CORE_FIELDS = (
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "ffn",
    "layers",
    "moe_topk",
    "moe_ffn",
    "shared_ffn",
)
"""ModelConfig fields the C++ core's ModelDims carries."""


@dataclass
class ModelConfig:
    """Transformer dimensions the cost model needs (defaults: Qwen3-30B-A3B-like)."""

    hidden: int = 2048
    """Model width H."""
    heads: int = 32
    """Query heads h."""
    kv_heads: int = 4
    """Key/value heads h_kv (GQA when smaller than heads)."""
    head_dim: int = 128
    """Head dimension d."""
    ffn: int = 6144
    """Dense SwiGLU intermediate size (used when moe_topk == 0)."""
    layers: int = 48
    """Transformer layers."""
    moe_topk: int = 8
    """Experts per token; 0 for a dense model."""
    moe_ffn: int = 768
    """Per-expert intermediate size."""
    shared_ffn: int = 0
    """Shared-expert intermediate size (0 = none)."""
    experts: int = 128
    """Routed experts per MoE layer (parameter count only)."""
    vocab: int = 151_936
    """Vocabulary size (parameter count only)."""
    qk_norm: bool = False
    """RMSNorm on each head's queries and keys before attention (Qwen3); training only."""
    rope_base: float = 10000.0
    """Rotary embedding base (theta); training only."""

    def __post_init__(self) -> None:
        for name in _CORE_FIELDS + ("experts", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"model.{name} must be an integer, got {value!r}")
            if not -(2**63) <= value < 2**63:
                raise ValueError(f"model.{name} = {value} is out of range (a 64-bit integer)")
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"model.qk_norm must be true or false, got {self.qk_norm!r}")
        if (
            isinstance(self.rope_base, bool)
            or not isinstance(self.rope_base, (int, float))
            or not self.rope_base > 1
        ):
            raise ValueError(f"model.rope_base must be a number > 1, got {self.rope_base!r}")
        self.to_core().validate()
        if self.moe_topk > self.experts:
            raise ValueError(
                f"model.moe_topk ({self.moe_topk}) exceeds model.experts ({self.experts})"
            )

    def param_count(self) -> float:
        """Parameters: attention projections, MLP or experts (+ shared expert and router), and
        input and output embeddings."""
        H = self.hidden
        attn = H * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * H
        if self.moe_topk > 0:
            mlp = self.experts * 3 * H * self.moe_ffn + 3 * H * self.shared_ffn + H * self.experts
        else:
            mlp = 3 * H * self.ffn
        return float(self.layers * (attn + mlp) + 2 * self.vocab * H)

    def to_core(self) -> "_core.ModelDims":
        dims = _core.ModelDims()
        for name in _CORE_FIELDS:
            setattr(dims, name, getattr(self, name))
        return dims


MODEL_PRESETS = {
    "qwen3-30b-a3b": ModelConfig(),
    "llama3-8b": ModelConfig(
        hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, layers=32, moe_topk=0, moe_ffn=0
    ),
}
"""Named model shapes of the planner and simulator command lines (`--model`)."""


def causal_pairs(length: int) -> int:
    """Causal (query, key) pairs of a document: l(l+1)/2."""
    return length * (length + 1) // 2


def block_pairs(a: int, b: int) -> int:
    """Pairs of query rows [a, b) of a document against their causal prefix."""
    return (b * (b + 1) - a * (a + 1)) // 2


def attn_fwd_flops(pairs: float, heads: int, head_dim: int) -> float:
    """Attention forward FLOPs: 4 * d * heads * pairs."""
    return 4.0 * head_dim * heads * pairs


def linear_fwd_flops_per_token(m: ModelConfig) -> float:
    """Forward FLOPs per token per layer of QKV/O projections and the SwiGLU MLP (or MoE)."""
    qkv_o = m.hidden * (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * m.head_dim * m.hidden
    ffn = m.moe_topk * m.moe_ffn + m.shared_ffn if m.moe_topk > 0 else m.ffn
    return 2.0 * qkv_o + 2.0 * 3.0 * m.hidden * ffn


@dataclass
class PackedSequence:
    """One packed sequence: its document lengths and cu_seqlens."""

    doc_lengths: list[int]
    cu_seqlens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.cu_seqlens:
            self.cu_seqlens = list(_core.cu_seqlens(self.doc_lengths))

    @property
    def tokens(self) -> int:
        return self.cu_seqlens[-1]


class PackedBatch:
    """A step's packed sequences in CSR form: sequence s holds the document lengths
    `lengths[offsets[s]:offsets[s + 1]]` (int64 numpy arrays). It reads like a list of lists
    (len, indexing, iteration and == give lists of ints), and the planner takes it without a copy
    (`Planner.plan`), so a step never goes through Python ints on its way to the planner."""

    __slots__ = ("lengths", "offsets")

    def __init__(self, lengths, offsets):
        self.lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        if self.offsets.ndim != 1 or len(self.offsets) == 0 or self.offsets[0] != 0:
            raise ValueError("offsets must be a 1-D array starting at 0")
        if self.offsets[-1] != len(self.lengths) or np.any(np.diff(self.offsets) < 0):
            raise ValueError("offsets must be non-decreasing and end at len(lengths)")

    @classmethod
    def from_lists(cls, sequences: Sequence[Sequence[int]]) -> "PackedBatch":
        counts = [len(s) for s in sequences]
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        flat = [int(x) for s in sequences for x in s]
        return cls(np.asarray(flat, dtype=np.int64), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            first, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(first, stop, step)]
            stop = max(first, stop)
            base = int(self.offsets[first])
            return PackedBatch(
                self.lengths[base : int(self.offsets[stop])], self.offsets[first : stop + 1] - base
            )
        i = range(len(self))[index]
        return self.lengths[self.offsets[i] : self.offsets[i + 1]].tolist()

    def __iter__(self):
        for s in range(len(self)):
            yield self[s]

    def __eq__(self, other) -> bool:
        if isinstance(other, PackedBatch):
            return np.array_equal(self.offsets, other.offsets) and np.array_equal(
                self.lengths, other.lengths
            )
        try:
            return self.tolist() == [list(s) for s in other]
        except TypeError:
            return NotImplemented

    def __repr__(self) -> str:
        return f"PackedBatch({len(self)} sequences, {self.n_documents} documents)"

    @property
    def n_documents(self) -> int:
        return len(self.lengths)

    def tokens(self) -> np.ndarray:
        """Tokens of each sequence."""
        cum = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=cum[1:])
        return cum[self.offsets[1:]] - cum[self.offsets[:-1]]

    def tolist(self) -> list[list[int]]:
        flat = self.lengths.tolist()
        off = self.offsets.tolist()
        return [flat[off[s] : off[s + 1]] for s in range(len(self))]


def document_count(sequences) -> int:
    """Documents in a step's sequences (a PackedBatch or lists)."""
    if isinstance(sequences, PackedBatch):
        return sequences.n_documents
    return sum(len(s) for s in sequences)


def _int_list(values: Iterable, field_name: str) -> list[int]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int,)) and not hasattr(v, "__index__"):
            raise ValueError(f"{field_name}[{i}] must be an integer, got {v!r}")
        out.append(int(v))
    return out


def pack_production(
    lengths: Sequence[int], context: int, max_sequences: int = 0
) -> list[PackedSequence]:
    """Sequential fill of `context`-token sequences, splitting documents at the boundary."""
    seqs = _core.pack_production(_int_list(lengths, "lengths"), int(context), int(max_sequences))
    return [PackedSequence(s) for s in seqs]


def pack_best_fit(lengths: Sequence[int], context: int) -> list[PackedSequence]:
    """Best-fit greedy knapsack packing; a document longer than `context` is an error."""
    return [
        PackedSequence(s) for s in _core.pack_best_fit(_int_list(lengths, "lengths"), int(context))
    ]


def read_lengths_file(path: str | os.PathLike) -> list[int]:
    """Read one positive integer per line: plain ASCII decimal digits (blank lines and '#'
    comments skipped); every error names the file and the line."""
    values: list[int] = []
    try:
        with open(path, "rb") as fh:
            raw_lines = fh.read().split(b"\n")
    except OSError as e:
        raise ValueError(f"lengths file {path}: cannot open ({e.strerror})") from None
    for lineno, raw in enumerate(raw_lines, start=1):
        try:
            line = raw.decode("ascii")
        except UnicodeDecodeError:
            raise ValueError(
                f"lengths file {path} line {lineno}: not ASCII text (a binary file?)"
            ) from None
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        if not text.isdigit():  # ASCII only here: no sign, underscore, spaces or exponent
            raise ValueError(
                f"lengths file {path} line {lineno}: {text[:40]!r} is not a positive integer"
            )
        value = int(text)
        if value <= 0 or value > MAX_TOKENS:
            raise ValueError(
                f"lengths file {path} line {lineno}: {value} is not in [1, {MAX_TOKENS}]"
            )
        values.append(value)
    if not values:
        raise ValueError(f"lengths file {path} is empty: it needs one positive integer per line")
    return values


@dataclass
class LengthSource:
    """Where document lengths come from: a named preset, or lengths drawn from a file."""

    preset: str | None = "libra-256k"
    """Preset name (see `preset_names()`); ignored when `lengths_file` is set."""
    lengths_file: str | None = None
    """File with one positive integer per line, drawn with replacement by seed."""
    shuffle_window: int = SAMPLE_SHUFFLE_WINDOW
    """Steps whose packed sequences are shuffled together, as Megatron's GPTDataset serves its
    packed samples through a random shuffle index: a step's sequences are a random draw from the
    packed stream, and the pieces of one long document land in different steps. 1: each step is
    its own production-packed stream, in packing order."""

    def __post_init__(self) -> None:
        self.shuffle_window = check_int(self.shuffle_window, "shuffle_window", 1)
        self._window = None  # _core.WindowCache, made at the first step
        if self.lengths_file is not None:
            self._dist = _core.LengthDist()
            self._dist.kind = "empirical"
            self._dist.values = read_lengths_file(self.lengths_file)
            self._dist.cap = max(self._dist.values)
        elif self.preset is not None:
            self._dist = _core.preset(self.preset)
        else:
            raise ValueError("workload: give a preset name or a lengths file")

    @classmethod
    def from_dist(cls, dist, name: str = "custom",
                  shuffle_window: int = SAMPLE_SHUFFLE_WINDOW) -> "LengthSource":
        """A source over a LengthDist built in code (e.g. a candidate while fitting presets),
        served exactly as a preset is."""
        src = cls.__new__(cls)
        src.preset, src.lengths_file = name, None
        src.shuffle_window = check_int(shuffle_window, "shuffle_window", 1)
        src._window, src._dist = None, dist
        return src

    @property
    def name(self) -> str:
        return f"file:{self.lengths_file}" if self.lengths_file else str(self.preset)

    def longer_than(self, context: int) -> int:
        """How many of a lengths file's documents exceed `context` tokens (production packing
        cuts them into context-length pieces); 0 for presets."""
        if not self.lengths_file:
            return 0
        return sum(1 for v in self._dist.values if v > context)

    def default_context(self) -> int | None:
        return None if self.lengths_file else PRESET_CONTEXT.get(self.preset)

    def sample(self, n: int, seed: int) -> list[int]:
        """n document lengths drawn with the given seed."""
        n = check_int(n, "n", 0)
        return list(_core.sample_lengths(self._dist, n, check_seed(seed)))

    def step(self, gbs: int, context: int, seed: int, step: int, threads: int = 0) -> PackedBatch:
        """The gbs packed sequences of one step: production packing of a seeded document stream,
        served through a shuffle of `shuffle_window` steps' samples (a function of (seed, step)).
        The window's sequences are made once (lengths drawn on `threads` threads, 0 =
        automatic; the result does not depend on it) and each step is a slice of them, copied
        out on as many threads."""
        gbs = check_int(gbs, "gbs", 1)
        context = check_int(context, "context", 1, MAX_TOKENS)
        seed = check_seed(seed)
        threads = check_int(threads, "threads", 0, 1024)
        step = check_int(step, "step", 0)
        if self._window is None or self._window.shuffle_window != self.shuffle_window:
            self._window = _core.WindowCache(self._dist, self.shuffle_window)
        return PackedBatch(*self._window.step(gbs, context, seed, step, threads))


SEED_LIMIT = 1 << 64
"""Seeds are unsigned 64-bit integers."""


def check_int(value, name: str, lo: int, hi: int = (1 << 63) - 1) -> int:
    """An integer in [lo, hi], or a ValueError naming `name`."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    v = int(value)
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def check_seed(seed, name: str = "seed") -> int:
    """A seed in [0, 2^64)."""
    return check_int(seed, name, 0, SEED_LIMIT - 1)


def preset_names() -> list[str]:
    return list(_core.preset_names())
