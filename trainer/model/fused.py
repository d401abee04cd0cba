"""Fewer, larger launches for the decoder layers: projections of one input as one GEMM, and the output gates as one
fused kernel on CUDA (``vision.fusion.cuda_compiled``; the plain PyTorch expression elsewhere)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kernels.grad_sink import ColumnSink, sinked_joint_linear
from vision.fusion import cuda_compiled

__all__ = ["joint_linear", "gated_rms_norm", "sigmoid_gate"]


def joint_linear(x: torch.Tensor, *parts: nn.Linear | Sequence[nn.Linear], sink: ColumnSink | None = None
                 ) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(x) for layer in parts)`` (bias-free layers) as one GEMM over their concatenated weights: one
    launch instead of one per layer forward, and in backward one input-gradient GEMM instead of one per layer plus
    the adds that sum them. The outputs are column slices of one ``[T, Σ out_features]`` buffer; a part that is a
    sequence of layers gets one slice for all of them (their outputs side by side). With ``sink``, consumers that
    know it write their slices' gradients into one buffer (``kernels.grad_sink.sinked_joint_linear``) instead of
    autograd concatenating them all."""
    groups = [tuple(part) if isinstance(part, Sequence) else (part,) for part in parts]
    weight = torch.cat([layer.weight for group in groups for layer in group])
    sizes = [sum(layer.out_features for layer in group) for group in groups]
    if sink is not None:
        return sinked_joint_linear(x, weight, sizes, sink)
    return F.linear(x, weight).split(sizes, dim=-1)


@cuda_compiled
def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor) -> torch.Tensor:
    """``RMSNorm(x) ⊙ sigmoid(gate)`` over the last dim of x ``[..., D]`` (gate of x's shape, any strides)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps) * torch.sigmoid(gate)


@cuda_compiled
def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x ⊙ sigmoid(gate)``."""
    return x * torch.sigmoid(gate)
