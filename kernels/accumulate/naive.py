"""The reference: PyTorch's in-place add, which casts x to the sum's dtype as it reads it."""
from __future__ import annotations

import torch


def naive_add_into(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``acc += x`` (acc float32, x any float dtype, the same number of elements); returns acc."""
    return acc.add_(x.view(acc.shape))
