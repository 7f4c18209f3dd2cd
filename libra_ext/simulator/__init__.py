"""Offline simulator: models step time per rank for every system from the planner's StepPlans,
reproduces the Libra paper's tables side by side, and recommends a pool size."""
