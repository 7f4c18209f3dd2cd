"""Core-attention runtime for Megatron-Core (DESIGN.md section 6): Ulysses, per-document CP
(WLB-LLM), and the Libra / DistCA tile exchange, exact against a single-device reference."""

BACKENDS = ("te", "flash", "varlen", "reference")
"""Attention kernels, best first (`kernels.select_backend` takes the first that can run);
here so that configs can name them without importing torch."""

DEFAULT_CHUNKS = 2
"""Rounds of the pool exchange pipeline unless configured (`system.chunks`)."""
