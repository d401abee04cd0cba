"""Token permutation: sort the (token, slot) pairs by expert, gather rows, combine back with gates.

Both directions are gathers, never atomics: the backward of the gather sums each token's k rows
through the inverse permutation, and the combine reads each token's k expert outputs. So the
results are deterministic and every row is summed in one place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RoutingPlan:
    """Where every (token, slot) pair goes. N = T·k slots, numbered `t·k + j`.

    order: int64 `[N]`, the slot at each sorted position (sorted by expert, stable);
    pos: int64 `[N]`, the sorted position of each slot (inverse of `order`);
    counts: int64 `[E]` rows per expert; offs: int32 `[E]` cumulative row ends (`torch._grouped_mm`'s).
    """

    order: torch.Tensor
    pos: torch.Tensor
    counts: torch.Tensor
    offs: torch.Tensor
    top_k: int


def plan_routing(expert_idx: torch.Tensor, n_experts: int) -> RoutingPlan:
    """Sort the slots of expert_idx `[T, k]` (int64) by expert; no host sync."""
    flat = expert_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=n_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return RoutingPlan(order=order, pos=pos, counts=counts, offs=offs, top_k=expert_idx.shape[1])


class PermuteFunction(torch.autograd.Function):
    """xs[p] = x[order[p] // k]; backward dx[t] = Σ_j dxs[pos[t·k + j]]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, pos: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(pos)
        ctx.top_k = top_k
        return x.index_select(0, order // top_k)

    @staticmethod
    def backward(ctx, dxs: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (pos,) = ctx.saved_tensors
        rows = dxs.index_select(0, pos)
        return rows.view(-1, ctx.top_k, rows.shape[1]).sum(1), None, None, None


class CombineFunction(torch.autograd.Function):
    """out[t] = Σ_j gates[t, j] · y[pos[t·k + j]]; gradients for y and the gates."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, gates: torch.Tensor, order: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y, gates, order, pos)
        y_tok = y.index_select(0, pos).view(gates.shape[0], gates.shape[1], y.shape[1])
        return torch.bmm(gates.unsqueeze(1).to(y.dtype), y_tok).squeeze(1)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        y, gates, order, pos = ctx.saved_tensors
        t, k = gates.shape
        dy_tok = gates.to(y.dtype).unsqueeze(2) * dout.unsqueeze(1)
        dy = dy_tok.view(t * k, -1).index_select(0, order)
        y_tok = y.index_select(0, pos).view(t, k, y.shape[1])
        dgates = torch.bmm(y_tok, dout.unsqueeze(2).to(y.dtype)).squeeze(2).to(gates.dtype)
        return dy, dgates, None, None


def permute(x: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """Gather x `[T, d]` into expert order -> `[T·k, d]` (one row per slot)."""
    return PermuteFunction.apply(x, plan.order, plan.pos, plan.top_k)


def combine(y: torch.Tensor, gates: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """Weighted sum of each token's k expert outputs: y `[T·k, d]` (expert order), gates `[T, k]` -> `[T, d]`."""
    return CombineFunction.apply(y, gates, plan.order, plan.pos)
