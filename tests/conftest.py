"""Shared test settings: hypothesis profiles sized for a 2-core CI machine, and one fork server
for the session's local ranks (the trainers' workers, the operator's multi-rank checks) that
imports torch and megatron-core once, whichever test starts it first."""

import os

from hypothesis import HealthCheck, settings

from libra_ext.distributed import start_method

start_method(("megatron.libra.worker_imports",))  # (sets what the server imports, if one is used)

settings.register_profile(
    "ci", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("LIBRA_HYPOTHESIS_PROFILE", "ci"))
