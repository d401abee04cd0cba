"""The short convolution's reference: a shift-and-add of its taps in float32 PyTorch (the truth for the kernels'
tests, and the CPU path)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.kda.l2norm import l2norm_reference


def naive_short_conv_silu(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
                          groups: int = 1, norm_groups: int = 0, head_dim: int = 1) -> tuple[torch.Tensor, ...]:
    """``silu(Σ_j weight[:, j] · x_{t−j})`` for x ``[T, C]`` (any strides) and weight ``[C, width]``, where
    ``x_{t−j}`` counts as zero once it lies before token t's document (``positions[t] < j``) or before the first
    row. Float32 math; returns ``groups`` contiguous tensors ``[T, C // groups]`` in x's dtype (channel c in group
    ``c // (C // groups)``). The first ``norm_groups`` outputs are divided by their L2 norm over each ``head_dim``
    channels, ``sqrt(|y|² + 1e-6)``, in float32.

    The zero is selected, not a subtraction, so no rounding residue of the previous document reaches a token."""
    T, C = x.shape
    xf, w = x.float(), weight.float()
    acc = xf * w[:, 0]
    for j in range(1, weight.shape[1]):
        shifted = F.pad(xf, (0, 0, j, 0))[:T]  # x_{t-j}
        acc = acc + torch.where((positions >= j)[:, None], shifted, 0.0) * w[:, j]
    ys = F.silu(acc).split(C // groups, dim=1)
    ys = [l2norm_reference(y.view(T, -1, head_dim)).view(T, -1) if g < norm_groups else y for g, y in enumerate(ys)]
    return tuple(y.to(x.dtype).contiguous() for y in ys)
