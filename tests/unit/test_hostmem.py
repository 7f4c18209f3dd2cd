"""`hostmem.retain_freed_memory`: needed, and effective, for attention on the CPU.

Each case runs in its own interpreter: glibc's thresholds are process-wide and cannot be undone.
"""

import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

_PROBE = r"""
import resource, sys
import numpy as np, torch
from libra_ext import hostmem
if sys.argv[1] == "retain":
    assert hostmem.retain_freed_memory()
    assert hostmem.retain_freed_memory()  # once per process; a second call changes nothing
torch.set_num_threads(1)
from libra_ext.attention.kernels import backend_for, segments_on
cu = np.array([0, 3000, 3500, 3600, 4096])  # one long document, three short ones
seg = segments_on(cu, cu, "cpu")
g = torch.Generator().manual_seed(0)
q = torch.randn(4096, 4, 32, generator=g, requires_grad=True)
k = torch.randn(4096, 2, 32, generator=g, requires_grad=True)
v = torch.randn(4096, 2, 32, generator=g, requires_grad=True)
kernel = backend_for(q, "reference")
def once():
    out = kernel.attend(q, k, v, seg, 32 ** -0.5)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
once()  # the first call grows the heap
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
    once()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                         timeout=120, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")
def test_freed_memory_is_reused_by_the_next_attention_call():
    # Without it, every forward + backward of the reference kernel maps its temporaries afresh:
    # tens of thousands of page faults per call at this size (and 6 million in one replay).
    # faults from elsewhere in the process (a busy machine, lazy imports) only add: the least of
    # three runs is the attention calls' own. Without retention glibc may, by its heap's layout
    # in that process, happen to keep the freed temporaries (126 faults in one clean-clone
    # run): the most of three runs shows what a call costs when it does not.
    # (the six interpreters two at a time: faults are counted per process)
    with ThreadPoolExecutor(max_workers=2) as pool:
        faults = list(pool.map(_faults, ["plain", "retain"] * 3))
    plain, retained = max(faults[0::2]), min(faults[1::2])
    assert plain > 5_000, plain
    assert retained < plain / 5, (retained, plain)
