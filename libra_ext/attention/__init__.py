"""Core-attention runtime for Megatron-Core (DESIGN.md section 6): Ulysses, per-document CP
(WLB-LLM), and the Libra / DistCA tile exchange, exact against a single-device reference."""
