"""Simulator configuration (configs/sim/*.yaml), validated with the field path in every error."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from libra_ext.memory import check_attention_memory
from libra_ext.planner import ORDERS
from libra_ext.workload import ModelConfig, preset_names

SYSTEMS = (
    "ulysses",
    "wlb",
    "distca",
    "distca-replica",
    "libra-tap",
    "libra-tap-vrsp",
    "libra",
    "megatron-dcp",
    "megatron-dyncp",
)
"""Simulated systems: baselines, Libra's ablations (TAP only; TAP + VRSP without the pipeline;
full), and megatron-core's own hybrid/dynamic CP scheduler. `distca` is DistCA as deployed (every
GPU an attention server, `system.distca_server: gpu`); `distca-replica` the planner's DistCA, one
server per replica (`replica`, the stronger variant)."""


def _int(d: dict, key: str, path: str, default=None, minimum: int = 1) -> int:
    v = d.get(key, default)
    if v is None:
        raise ValueError(f"{path}.{key} is missing")
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{path}.{key} must be an integer >= {minimum}, got {v!r}")
    return v


def _int_list(d: dict, key: str, path: str) -> list[int]:
    v = d.get(key)
    if not isinstance(v, list) or not v:
        raise ValueError(f"{path}.{key} must be a non-empty list of positive integers")
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{path}.{key}[{i}] must be a positive integer, got {x!r}")
    return v


@dataclass
class Scenario:
    name: str
    workload: str
    """Preset name, or `file:PATH` for a lengths file."""
    context: int
    gbs: int
    cp: int
    tp: int
    pool_size: int
    dp: list[int]
    sweep_dp: int
    sweep_pools: list[int]


@dataclass
class SimConfig:
    hardware: str
    model: ModelConfig
    steps: int
    dcp_steps: int
    seed: int
    chunks: int
    systems: list[str]
    scenarios: list[Scenario]
    reference: dict = field(default_factory=dict)
    path: str = ""
    order: str = "megatron"
    """Production order of each step's sequences (megatron | contiguous; see PlannerOptions)."""
    pp: int = 4
    """Pipeline stages of the modeled 1F1B bubble (`pipeline_stages`; libra_ext.pipeline)."""
    attention_memory: str = "keep"
    """system.attention_memory of libra, distca-replica, ulysses and wlb (keep | owner |
    rebuild): what owner and rebuild send again in the backward is priced (simulate_plan)."""
    cost_table: object = None
    """A `costmodel.CostTable` libra, distca and wlb balance instead of causal pairs (`libra simulate
    --cost-table`); None: pairs."""

    @classmethod
    def load(cls, path: str | Path) -> "SimConfig":
        p = Path(path)
        try:
            with open(p, encoding="utf-8") as fh:
                d = yaml.safe_load(fh)
        except OSError as e:
            raise ValueError(f"simulate config {path}: cannot open ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ValueError(f"simulate config {path}: not valid YAML ({e})") from None
        return cls.from_dict(d, base=p.parent, path=str(p))

    @classmethod
    def from_dict(cls, d: dict, base: Path = Path("."), path: str = "") -> "SimConfig":
        if not isinstance(d, dict):
            raise ValueError("simulate config must be a mapping")
        known = {
            "hardware",
            "model",
            "steps",
            "dcp_steps",
            "seed",
            "pipeline_chunks",
            "pipeline_stages",
            "systems",
            "reference",
            "scenarios",
            "order",
            "attention_memory",
        }
        for k in d:
            if k not in known:
                raise ValueError(f"simulate config: unknown key {k!r}")
        model_d = d.get("model", {})
        if not isinstance(model_d, dict):
            raise ValueError("model must be a mapping of ModelConfig fields")
        fields_ok = set(ModelConfig.__dataclass_fields__)
        for k in model_d:
            if k not in fields_ok:
                raise ValueError(f"model.{k} is not a model field ({', '.join(sorted(fields_ok))})")
        model = ModelConfig(**model_d)
        systems = d.get("systems", list(SYSTEMS))
        if not isinstance(systems, list) or not systems:
            raise ValueError("systems must be a non-empty list")
        for i, s in enumerate(systems):
            if s not in SYSTEMS:
                raise ValueError(f"systems[{i}] = {s!r} is not one of {', '.join(SYSTEMS)}")
        scen_d = d.get("scenarios")
        if not isinstance(scen_d, dict) or not scen_d:
            raise ValueError("scenarios must be a non-empty mapping of name -> scenario")
        scenarios = []
        for name, s in scen_d.items():
            sp = f"scenarios.{name}"
            if not isinstance(s, dict):
                raise ValueError(f"{sp} must be a mapping")
            workload = s.get("workload")
            if workload not in preset_names() and not str(workload).startswith("file:"):
                raise ValueError(
                    f"{sp}.workload must be one of {', '.join(preset_names())} "
                    f"or file:PATH, got {workload!r}"
                )
            sweep = s.get("pool_sweep", {})
            if not isinstance(sweep, dict):
                raise ValueError(f"{sp}.pool_sweep must be a mapping")
            sc = Scenario(
                name=str(name),
                workload=str(workload),
                context=_int(s, "context", sp),
                gbs=_int(s, "gbs", sp),
                cp=_int(s, "cp", sp),
                tp=_int(s, "tp", sp, 1),
                pool_size=_int(s, "pool_size", sp),
                dp=_int_list(s, "dp", sp),
                sweep_dp=_int(sweep, "dp", f"{sp}.pool_sweep", max(s.get("dp", [1]))),
                sweep_pools=_int_list(sweep, "pool_sizes", f"{sp}.pool_sweep")
                if "pool_sizes" in sweep
                else [s.get("pool_size", 1)],
            )
            for i, dp in enumerate(sc.dp):
                if sc.gbs % dp:
                    raise ValueError(f"{sp}.dp[{i}] = {dp} does not divide gbs {sc.gbs}")
                if dp >= sc.pool_size and dp % sc.pool_size:
                    raise ValueError(
                        f"{sp}.pool_size = {sc.pool_size} does not divide {sp}.dp[{i}] = {dp} "
                        "(below the pool size the pool is all of dp)"
                    )
            if sc.gbs % sc.sweep_dp and sc.sweep_dp % sc.gbs:
                raise ValueError(f"{sp}.pool_sweep.dp = {sc.sweep_dp} and gbs {sc.gbs} must divide")
            for i, p in enumerate(sc.sweep_pools):
                if sc.sweep_dp % p:
                    raise ValueError(
                        f"{sp}.pool_sweep.pool_sizes[{i}] = {p} does not divide "
                        f"pool_sweep.dp {sc.sweep_dp}"
                    )
            if model.heads % (sc.cp * sc.tp):
                raise ValueError(
                    f"{sp}: model.heads ({model.heads}) must be divisible by cp*tp "
                    f"({sc.cp * sc.tp})"
                )
            scenarios.append(sc)
        reference = {}
        ref = d.get("reference")
        if ref:
            rp = Path(ref) if Path(ref).is_absolute() else base / ref
            try:
                with open(rp, encoding="utf-8") as fh:
                    reference = yaml.safe_load(fh) or {}
            except OSError as e:
                raise ValueError(f"reference {rp}: cannot open ({e.strerror})") from None
        order = d.get("order", "megatron")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        attention_memory = d.get("attention_memory", "keep")
        check_attention_memory(attention_memory)
        return cls(
            order=order,
            attention_memory=attention_memory,
            hardware=str(d.get("hardware", "h100-sxm")),
            model=model,
            steps=_int(d, "steps", "config", 6),
            dcp_steps=_int(d, "dcp_steps", "config", 2),
            seed=_int(d, "seed", "config", 0, minimum=0),
            chunks=_int(d, "pipeline_chunks", "config", 4),
            pp=_int(d, "pipeline_stages", "config", 4),
            systems=systems,
            scenarios=scenarios,
            reference=reference,
            path=path,
        )
