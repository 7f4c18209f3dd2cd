"""Libra's THD RoPE (megatron.libra.rope) rotates every slot by its position inside its
document exactly as megatron-core's own THD path does, without splitting by document."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from libra_ext.attention import thd
from megatron.libra import rope


class _Cp:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_positions_rope_equals_megatron_thd_rope(cp):
    from megatron.core.models.common.embeddings import rope_utils

    rng = np.random.default_rng(cp)
    L = rng.integers(1, 40, size=9)
    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False,
                             multi_latent_attention=False)
    freqs = torch.randn(int(thd.padded_lengths(L, cp).max()), 1, 1, 16, dtype=torch.float64)
    cu = torch.tensor(np.r_[0, np.cumsum(thd.padded_lengths(L, cp))], dtype=torch.int32)
    ours = rope._positions_rope(rope_utils.apply_rotary_pos_emb,
                                rope_utils._apply_rotary_pos_emb_bshd)
    for rank in range(cp):
        z = thd.zigzag_split(L, cp, rank)
        t = torch.randn(len(z.position_ids), 4, 16, dtype=torch.float64)
        want = rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu,
                                               cp_group=_Cp(cp, rank))
        tagged = cu.clone()
        rope.register(tagged, rope.Positions(torch.as_tensor(z.position_ids)))
        got = ours(t, freqs, config, cu_seqlens=tagged, cp_group=_Cp(cp, rank))
        assert torch.equal(got, want)
        # without the positions, the call is megatron-core's own
        assert torch.equal(ours(t, freqs, config, cu_seqlens=cu, cp_group=_Cp(cp, rank)), want)


def test_install_is_idempotent_and_wraps_megatron_attention():
    from megatron.core.transformer import attention

    rope.install()
    first = attention.apply_rotary_pos_emb
    rope.install()
    assert attention.apply_rotary_pos_emb is first and first.libra_positions_rope
