"""Libra plugin for Megatron-Core: workload and cost model, planner facade, checks.

The planner core is C++ (``libra_ext._planner``); this package gives it typed Python faces.
Modules here import without torch; only the Megatron integration modules need it.
"""

__version__ = "0.1.0"
