"""The GPU-readiness gate: the runtime's device code run on fake CUDA tensors on a CPU-only
PyTorch (`harness`), with stand-ins for the kernels and collectives (`standins`), checked for
device mismatches, host reads, blocking transfers, kernel counts that grow with documents and
activation memory (`gate`). `python -m megatron.libra.gpu_ready` runs it in a process of its own."""
