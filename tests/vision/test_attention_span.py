"""Views handed to FlexAttention: a copy only where the view spans more memory than 32-bit offsets reach."""
from __future__ import annotations

import torch

from vision.attention import compact_if_huge


def test_compact_if_huge_copies_only_views_spanning_the_limit() -> None:
    joint = torch.randn(100, 40)   # rows of a joint projection; q is its first 16 columns as [1, H, T, D]
    q = joint[:, :16].reshape(100, 2, 8).transpose(0, 1).unsqueeze(0)
    span = 1 * 8 + 99 * 40 + 7 * 1 + 1   # the last element's offset from the first, plus one
    assert compact_if_huge(q, limit=span + 1) is q
    small = compact_if_huge(q, limit=span)
    assert small.is_contiguous() and torch.equal(small, q)
    assert compact_if_huge(torch.empty(0, 4), limit=1).numel() == 0
