"""Token permutation: sort the (token, slot) pairs by expert, gather rows, combine back with gates.

Both directions are gathers, never atomics: the backward of the gather sums each token's k rows
through the inverse permutation, and the combine reads each token's k expert outputs. So the
results are deterministic and every row is summed in one place (fp32 in the Triton kernels, which
also fuse the gate weighting and the gate gradient into those single passes over the rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .grouped_gemm import resolve_backend


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


def expert_counts(expert_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Slots per expert, int64 `[E]`; a scatter-add, since `torch.bincount` syncs the host on CUDA."""
    flat = expert_idx.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def plan_routing(expert_idx: torch.Tensor, n_experts: int) -> RoutingPlan:
    """Sort the slots of expert_idx `[T, k]` (int64) by expert; no host sync."""
    flat = expert_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    counts = expert_counts(flat, n_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return RoutingPlan(order=order, pos=pos, counts=counts, offs=offs, top_k=expert_idx.shape[1])


@triton.jit
def combine_fwd_kernel(y_ptr, gates_ptr, pos_ptr, out_ptr, D, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                       WEIGHTED: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t, cols] = Σ_j g[t, j] · y[pos[t·k + j], cols] (g = 1 unless WEIGHTED), fp32 sum."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, K_POW2)
    mask_j = j < TOP_K
    rows = tl.load(pos_ptr + t * TOP_K + j, mask=mask_j, other=0)
    mask = mask_j[:, None] & (cols < D)[None, :]
    y = tl.load(y_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if WEIGHTED:
        g = tl.load(gates_ptr + t * TOP_K + j, mask=mask_j, other=0.0)
        y = y * g[:, None]
    tl.store(out_ptr + t * D + cols, tl.sum(y, axis=0).to(out_ptr.dtype.element_ty), mask=cols < D)


@triton.jit
def combine_bwd_kernel(y_ptr, gates_ptr, pos_ptr, dout_ptr, dy_ptr, dgates_ptr, D,
                       TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_D: tl.constexpr):
    """For token t: dy[pos[t·k + j]] = g[t, j] · dout[t] and dgates[t, j] = ⟨y[pos[t·k + j]], dout[t]⟩."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_POW2)
    mask_j = j < TOP_K
    rows = tl.load(pos_ptr + t * TOP_K + j, mask=mask_j, other=0)
    g = tl.load(gates_ptr + t * TOP_K + j, mask=mask_j, other=0.0)
    dg = tl.zeros((K_POW2,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask_d = cols < D
        mask = mask_j[:, None] & mask_d[None, :]
        dout = tl.load(dout_ptr + t * D + cols, mask=mask_d, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dg += tl.sum(y * dout[None, :], axis=1)
        dy = g[:, None] * dout[None, :]
        tl.store(dy_ptr + rows[:, None] * D + cols[None, :], dy.to(dy_ptr.dtype.element_ty), mask=mask)
    tl.store(dgates_ptr + t * TOP_K + j, dg, mask=mask_j)


def gather_sum(y: torch.Tensor, gates: torch.Tensor | None, pos: torch.Tensor, top_k: int) -> torch.Tensor:
    """Triton launch: `[T, d]` sums of each token's k rows of y `[T·k, d]`, weighted by gates `[T, k]` if given."""
    n_tokens, d = pos.numel() // top_k, y.shape[1]
    out = torch.empty(n_tokens, d, dtype=y.dtype, device=y.device)
    block_d = min(triton.next_power_of_2(d), 1024 if y.is_cuda else 64)
    grid = (n_tokens, triton.cdiv(d, block_d))
    combine_fwd_kernel[grid](y, pos if gates is None else gates, pos, out, d, TOP_K=top_k,
                             K_POW2=triton.next_power_of_2(top_k), WEIGHTED=gates is not None, BLOCK_D=block_d)
    return out


def combine_bwd(y: torch.Tensor, gates: torch.Tensor, pos: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launch: dy `[T·k, d]` (expert order) and dgates fp32 `[T, k]`."""
    n_tokens, top_k = gates.shape
    d = y.shape[1]
    dy = torch.empty_like(y)
    dgates = torch.empty(n_tokens, top_k, dtype=torch.float32, device=y.device)
    block_d = min(triton.next_power_of_2(d), 512 if y.is_cuda else 64)
    combine_bwd_kernel[(n_tokens,)](y, gates, pos, dout, dy, dgates, d, TOP_K=top_k,
                                    K_POW2=triton.next_power_of_2(top_k), BLOCK_D=block_d)
    return dy, dgates


class PermuteFunction(torch.autograd.Function):
    """xs[p] = x[order[p] // k]; backward dx[t] = Σ_j dxs[pos[t·k + j]]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, pos: torch.Tensor, top_k: int, use_triton: bool) -> torch.Tensor:
        ctx.save_for_backward(pos)
        ctx.top_k, ctx.use_triton = top_k, use_triton
        return x.index_select(0, order // top_k)

    @staticmethod
    def backward(ctx, dxs: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        (pos,) = ctx.saved_tensors
        dxs = dxs.contiguous()
        if ctx.use_triton:
            return gather_sum(dxs, None, pos, ctx.top_k), None, None, None, None
        rows = dxs.index_select(0, pos)
        return rows.view(-1, ctx.top_k, rows.shape[1]).sum(1), None, None, None, None


class CombineFunction(torch.autograd.Function):
    """out[t] = Σ_j gates[t, j] · y[pos[t·k + j]]; gradients for y and the gates."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, gates: torch.Tensor, order: torch.Tensor, pos: torch.Tensor,
                use_triton: bool) -> torch.Tensor:
        y, gates = y.contiguous(), gates.contiguous()
        ctx.save_for_backward(y, gates, order, pos)
        ctx.use_triton = use_triton
        if use_triton:
            return gather_sum(y, gates, pos, gates.shape[1])
        y_tok = y.index_select(0, pos).view(gates.shape[0], gates.shape[1], y.shape[1])
        return torch.bmm(gates.unsqueeze(1).to(y.dtype), y_tok).squeeze(1)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        y, gates, order, pos = ctx.saved_tensors
        dout = dout.contiguous()
        if ctx.use_triton:
            dy, dgates = combine_bwd(y, gates, pos, dout)
            return dy, dgates.to(gates.dtype), None, None, None
        t, k = gates.shape
        dy_tok = gates.to(y.dtype).unsqueeze(2) * dout.unsqueeze(1)
        dy = dy_tok.view(t * k, -1).index_select(0, order)
        y_tok = y.index_select(0, pos).view(t, k, y.shape[1])
        dgates = torch.bmm(y_tok, dout.unsqueeze(2).to(y.dtype)).squeeze(2).to(gates.dtype)
        return dy, dgates, None, None, None


def permute(x: torch.Tensor, plan: RoutingPlan, backend: str = "auto") -> torch.Tensor:
    """Gather x `[T, d]` into expert order -> `[T·k, d]` (one row per slot). The backward's
    gather-sum runs in Triton unless backend resolves to the loop reference."""
    return PermuteFunction.apply(x, plan.order, plan.pos, plan.top_k, resolve_backend(backend, x) != "loop")


def combine(y: torch.Tensor, gates: torch.Tensor, plan: RoutingPlan, backend: str = "auto") -> torch.Tensor:
    """Weighted sum of each token's k expert outputs: y `[T·k, d]` (expert order), gates `[T, k]` -> `[T, d]`."""
    return CombineFunction.apply(y, gates, plan.order, plan.pos, resolve_backend(backend, y) != "loop")
