"""Hardware profiles (configs/hardware/*.yaml): compute peaks, the attention efficiency curve,
and the alpha-beta network model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

HARDWARE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"
MEASURED_SCHEMA = 1
"""Version of a profile's `measured` section (`libra calibrate`)."""


def _get(d: dict, key: str, path: str, kind=float):
    if not isinstance(d, dict) or key not in d:
        raise ValueError(f"{path}.{key} is missing")
    v = d[key]
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise ValueError(f"{path}.{key} must be a number, got {v!r}")
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise ValueError(f"{path}.{key} must be an integer, got {v!r}")
    if kind in (int, float) and not v > 0 and key != "exposed_fraction":
        raise ValueError(f"{path}.{key} must be positive, got {v!r}")
    return kind(v) if kind in (int, float) else v


@dataclass(frozen=True)
class Link:
    """One alpha-beta link: time = messages * latency + bytes / bandwidth."""

    bandwidth: float
    """Bytes per second per GPU per direction."""
    latency: float
    """Seconds per message."""


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    bf16_peak: float
    """Dense BF16 FLOP/s per GPU."""
    attn_peak: float
    """Long-sequence attention FLOP/s (forward)."""
    curve_tokens: tuple
    curve_eff: tuple
    attn_bwd_speed: float
    """Backward attention speed as a fraction of forward."""
    call_floor: float
    """Seconds per attention kernel call."""
    linear_efficiency: float
    gpus_per_node: int
    nvlink: Link
    internode: Link
    grad_bytes_per_param: int
    allreduce_exposed: float
    memory_gb: float | None = None
    """Device memory (GB, 10^9 bytes) for `libra memory`; None: not given."""
    copy_bandwidth: float = 3.0e12
    """Bytes per second a device-side copy, gather or scatter moves (read + written): what the
    attention operator's data path around its kernels costs (`operator.copy_bandwidth_gbps`)."""
    launch: float = 4e-6
    """Seconds per device op the operator launches (`operator.launch_us`)."""
    measured: dict | None = None
    """What `libra calibrate` measured (device, date, kernel, ...); None: published figures."""

    @property
    def source(self) -> str:
        """Where the attention figures come from, in words."""
        if self.measured is None:
            return "published figures"
        m = self.measured
        return f"measured on {m['device']} ({m['date']}, {m.get('backend', '?')} kernel)"

    @classmethod
    def load(cls, path_or_name: str | Path) -> "HardwareProfile":
        p = Path(path_or_name)
        if not p.exists():
            p = HARDWARE_DIR / f"{path_or_name}.yaml"
        if not p.exists():
            known = ", ".join(sorted(x.stem for x in HARDWARE_DIR.glob("*.yaml")))
            raise ValueError(f"hardware: no profile {path_or_name!r} (known: {known})")
        with open(p, encoding="utf-8") as fh:
            d = yaml.safe_load(fh)
        return cls.from_dict(d, str(p.name))

    @classmethod
    def from_dict(cls, d: dict, where: str = "hardware") -> "HardwareProfile":
        path = "hardware"
        if not isinstance(d, dict):
            raise ValueError(f"{where}: a hardware profile must be a mapping")
        att = _get(d, "attention", path, dict)
        curve = _get(att, "curve", f"{path}.attention", list)
        if not curve or any(not isinstance(c, list) or len(c) != 2 for c in curve):
            raise ValueError(f"{path}.attention.curve must be a list of [tokens, efficiency]")
        tokens = [float(c[0]) for c in curve]
        eff = [float(c[1]) for c in curve]
        if any(b <= a for a, b in zip(tokens, tokens[1:])) or min(tokens) <= 0:
            raise ValueError(f"{path}.attention.curve tokens must be positive and increasing")
        if any(not 0 < e <= 1.0 for e in eff):
            raise ValueError(f"{path}.attention.curve efficiencies must be in (0, 1]")
        nv, ib, ar = (_get(d, k, path, dict) for k in ("nvlink", "internode", "allreduce"))
        exposed = float(ar.get("exposed_fraction", 0.2))
        if not 0 <= exposed <= 1:
            raise ValueError(f"{path}.allreduce.exposed_fraction must be in [0, 1]")
        measured = d.get("measured")
        if measured is not None:
            if not isinstance(measured, dict):
                raise ValueError(f"{path}.measured must be a mapping")
            if measured.get("schema") != MEASURED_SCHEMA:
                raise ValueError(
                    f"{path}.measured.schema must be {MEASURED_SCHEMA} (written by this version's "
                    f"`libra calibrate`), got {measured.get('schema')!r}"
                )
            for key in ("device", "date"):
                if not isinstance(measured.get(key), str) or not measured[key]:
                    raise ValueError(f"{path}.measured.{key} must be a non-empty string")
        memory = d.get("memory_gb")
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float))
                                   or not memory > 0):
            raise ValueError(f"{path}.memory_gb must be a positive number, got {memory!r}")
        op = d.get("operator", {})
        if not isinstance(op, dict):
            raise ValueError(f"{path}.operator must be a mapping")
        return cls(
            measured=measured,
            memory_gb=float(memory) if memory is not None else None,
            copy_bandwidth=_get(op, "copy_bandwidth_gbps", f"{path}.operator") * 1e9
            if "copy_bandwidth_gbps" in op else cls.copy_bandwidth,
            launch=_get(op, "launch_us", f"{path}.operator") * 1e-6
            if "launch_us" in op else cls.launch,
            name=str(d.get("name", where)),
            bf16_peak=_get(d, "bf16_peak_tflops", path) * 1e12,
            attn_peak=_get(att, "peak_tflops", f"{path}.attention") * 1e12,
            curve_tokens=tuple(tokens),
            curve_eff=tuple(eff),
            attn_bwd_speed=_get(att, "backward_speed_ratio", f"{path}.attention"),
            call_floor=_get(att, "call_floor_us", f"{path}.attention") * 1e-6,
            linear_efficiency=_get(d, "linear_efficiency", path),
            gpus_per_node=_get(d, "gpus_per_node", path, int),
            nvlink=Link(
                _get(nv, "bandwidth_gbps", f"{path}.nvlink") * 1e9,
                _get(nv, "latency_us", f"{path}.nvlink") * 1e-6,
            ),
            internode=Link(
                _get(ib, "bandwidth_gbps", f"{path}.internode") * 1e9,
                _get(ib, "latency_us", f"{path}.internode") * 1e-6,
            ),
            grad_bytes_per_param=_get(ar, "grad_bytes_per_param", f"{path}.allreduce", int),
            allreduce_exposed=exposed,
        )

    def attn_efficiency(self, tokens: np.ndarray) -> np.ndarray:
        """Fraction of `attn_peak` reached at an attended length (log-linear interpolation,
        clamped at the curve's ends)."""
        x = np.log(np.maximum(np.asarray(tokens, dtype=np.float64), 1.0))
        return np.interp(x, np.log(self.curve_tokens), self.curve_eff)

    def link(self, same_node: bool) -> Link:
        return self.nvlink if same_node else self.internode

    def ring_allreduce(self, nbytes: float, n: int, same_node: bool) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        link = self.link(same_node)
        return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency
