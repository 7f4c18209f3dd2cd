"""The planner-side commands of `libra` (plan, bench, simulate, recommend-pool, calibrate,
verify): argument parsers and their implementations. They import no torch or megatron-core at
module load (commands that run kernels import torch inside), so `libra plan` starts at once;
`megatron.libra.cli` assembles them with the training commands."""
