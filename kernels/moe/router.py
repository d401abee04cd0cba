"""Sigmoid router with a balancing bias that chooses experts but never weights them.

Token i picks `topk_j(s_ij + b_j)` with `s = sigmoid(x Wᵀ)`; its gates are the unbiased `s_ij` of the
chosen experts, normalised over the k and multiplied by `gate_scale`, so gradients reach W through
the gates while b (set by quantile balancing, not by gradient) only moves the choice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .topk import biased_topk


@dataclass(frozen=True, slots=True)
class Routing:
    """One forward's routing. expert_idx int64 `[T, k]`; gates fp32 `[T, k]` (differentiable);
    scores fp32 `[T, E]` (detached sigmoid scores); alpha fp32 `[T]`, the (k+1)-th largest `s_i + b`,
    kept for the bias update."""

    expert_idx: torch.Tensor
    gates: torch.Tensor
    scores: torch.Tensor
    alpha: torch.Tensor


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, gate_scale: float = 1.0) -> Routing:
    """Route tokens x `[T, d]` with router weight `[E, d]` and bias fp32 `[E]` to top_k experts.

    The logits are computed in x's dtype (the router GEMM stays cheap in bf16) and the sigmoid in fp32.
    """
    n_experts = weight.shape[0]
    if not 1 <= top_k < n_experts:
        raise ValueError(f"top_k must be in [1, {n_experts}), got {top_k}")
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [T, {weight.shape[1]}], got {tuple(x.shape)}")
    if bias.shape != (n_experts,):
        raise ValueError(f"bias must be [{n_experts}], got {tuple(bias.shape)}")
    return _route(x, weight, bias, top_k, gate_scale)


def _route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, gate_scale: float) -> Routing:
    """Unchecked `route` (the layer validates its configuration once, at construction)."""
    return route_logits(F.linear(x, weight), bias, top_k, gate_scale)


def route_logits(logits: torch.Tensor, bias: torch.Tensor, top_k: int, gate_scale: float) -> Routing:
    """Unchecked `route` from the router's logits `x Wᵀ` `[T, E]` (the layer gets them from one GEMM with the shared
    expert's up projection)."""
    scores = torch.sigmoid(logits.float())
    biased, chosen = biased_topk(scores.detach(), bias, top_k + 1)
    expert_idx = chosen[:, :top_k]
    picked = scores.gather(1, expert_idx)
    gates = picked * (gate_scale / picked.sum(-1, keepdim=True))
    return Routing(expert_idx=expert_idx, gates=gates, scores=scores.detach(), alpha=biased[:, top_k])
