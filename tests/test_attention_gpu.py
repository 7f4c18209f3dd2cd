"""Single-GPU backend equivalence: every available backend agrees with the CPU reference.
Skipped without CUDA; scripts/gpu_check.sh runs it on a GPU machine."""

import pytest
import torch

from libra_ext.attention import kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("n_q, n_k, hq, hk", [(256, 256, 8, 2), (128, 1024, 4, 4), (1, 64, 2, 1)])
def test_backends_agree_with_reference(dtype, tol, n_q, n_k, hq, hk):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(n_q, hq, 64, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(n_k, hk, 64, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(n_k, hk, 64, device="cuda", dtype=dtype, generator=g)
    ref, _ = kernels.reference_attention(
        q.double().cpu(), k.double().cpu(), v.double().cpu(), 0.125
    )
    names = ["torch-gpu"] + (["flash"] if kernels.HAVE_FLASH and dtype != torch.float32 else [])
    for name in names:
        out, _ = kernels.Backend(name)(q, k, v, 0.125)
        assert (out.double().cpu() - ref).abs().max() < tol, name
