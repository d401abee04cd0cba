"""Token permutation: sort the (token, slot) pairs by expert, spread rows into expert order, sum them back.

The two are each other's transpose, and neither uses atomics: the permutation's backward and the combine's forward
sum each token's k rows through the inverse permutation (a gather); the combine's backward and the permutation's
forward copy each token's row to its k slots (each slot written once). So the results are deterministic and every
row is summed in one place (fp32 in the Triton kernel). The gates are not applied here but to the experts'
activations (``swiglu(..., scale=)``), so the combine keeps no `[T·k, d]` expert outputs for their gradient.

The copy to the k slots runs token by token (``spread_rows``): each token's row is read once and written k times.
As a gather of the `T·k` slots (``index_select`` by token, sorted by expert) it read each token's row k times, in
expert order, from a `[T, d]` source larger than L2 at the 8k stage (134 MB): about 1.07 GB moved a call against
0.67 (65,536 tokens, top-4, d = 1,024), twice a MoE layer (the first expert GEMM's input, the combine's gradient).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.grad_sink import GradSink

from .grouped_gemm import grouped_mm_nograd, grouped_wgrad_nograd, loop_grouped_mm, resolve_backend


@dataclass(frozen=True, slots=True)
class RoutingPlan:
    """Where every (token, slot) pair goes. N = T·k slots, numbered `t·k + j`.

    order: int64 `[N]`, the slot at each sorted position (sorted by expert, stable);
    token: int64 `[N]`, the token of each sorted position (`order // k`: the row the permutation copies there);
    pos: int64 `[N]`, the sorted position of each slot (inverse of `order`);
    counts: int64 `[E]` rows per expert; offs: int32 `[E]` cumulative row ends (`torch._grouped_mm`'s).
    """

    order: torch.Tensor
    token: torch.Tensor
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
    top_k = expert_idx.shape[1]
    return RoutingPlan(order=order, token=order // top_k, pos=pos, counts=counts, offs=offs, top_k=top_k)


def column_block(d: int, x: torch.Tensor) -> int:
    """Columns per program of the row kernels (one token a program): the whole row up to 1,024 on a GPU, 64 under
    the interpreter (speed)."""
    return min(triton.next_power_of_2(d), 1024 if x.is_cuda else 64)


@triton.jit
def gather_sum_kernel(y_ptr, pos_ptr, out_ptr, D, TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_D: tl.constexpr,
                      ACC: tl.constexpr):
    """out[t, cols] (+)= Σ_j y[pos[t·k + j], cols], fp32 sum (added to what out holds if ACC)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, K_POW2)
    mask_j = j < TOP_K
    rows = tl.load(pos_ptr + t * TOP_K + j, mask=mask_j, other=0)
    mask = mask_j[:, None] & (cols < D)[None, :]
    y = tl.load(y_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    total = tl.sum(y, axis=0)
    if ACC:
        total += tl.load(out_ptr + t * D + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + cols, total.to(out_ptr.dtype.element_ty), mask=cols < D)


def gather_sum(y: torch.Tensor, pos: torch.Tensor, top_k: int, into: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launch: `[T, d]` sums of each token's k rows of y `[T·k, d]`, added into ``into`` (contiguous, y's
    dtype) when given."""
    n_tokens, d = pos.numel() // top_k, y.shape[1]
    out = torch.empty(n_tokens, d, dtype=y.dtype, device=y.device) if into is None else into
    if out.shape != (n_tokens, d) or out.dtype != y.dtype or not out.is_contiguous():
        raise ValueError(f"into: must be contiguous [{n_tokens}, {d}] {y.dtype}, got {out.dtype} {tuple(out.shape)}")
    block_d = column_block(d, y)
    grid = (n_tokens, triton.cdiv(d, block_d))
    gather_sum_kernel[grid](y, pos, out, d, TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k), BLOCK_D=block_d,
                            ACC=into is not None)
    return out


@triton.jit
def spread_rows_kernel(x_ptr, pos_ptr, out_ptr, D, TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[pos[t·k + j], cols] = x[t, cols] for the k slots j of token t."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = cols < D
    j = tl.arange(0, K_POW2)
    mask_j = j < TOP_K
    rows = tl.load(pos_ptr + t * TOP_K + j, mask=mask_j, other=0)
    x = tl.load(x_ptr + t * D + cols, mask=m_d, other=0.0)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], tl.broadcast_to(x[None, :], (K_POW2, BLOCK_D)),
             mask=mask_j[:, None] & m_d[None, :])


def spread_rows(x: torch.Tensor, pos: torch.Tensor, top_k: int) -> torch.Tensor:
    """Triton launch: `[T·k, d]` in expert order, row ``pos[t·k + j]`` a copy of x's row t (x `[T, d]`)."""
    x = x.contiguous()
    n_tokens, d = x.shape
    out = torch.empty(n_tokens * top_k, d, dtype=x.dtype, device=x.device)
    block_d = column_block(d, x)
    spread_rows_kernel[(n_tokens, triton.cdiv(d, block_d))](x, pos, out, d, TOP_K=top_k,
                                                            K_POW2=triton.next_power_of_2(top_k), BLOCK_D=block_d)
    return out


def _spread_slots(x: torch.Tensor, token: torch.Tensor, pos: torch.Tensor, top_k: int, use_triton: bool
                  ) -> torch.Tensor:
    """`[T·k, d]`: slot p's row is x's row token[p] (pos, its inverse: token t's slots)."""
    return spread_rows(x, pos, top_k) if use_triton else x.index_select(0, token)


def _sum_slots(y: torch.Tensor, pos: torch.Tensor, top_k: int, use_triton: bool) -> torch.Tensor:
    """`[T, d]`: token t's row is the sum of y's rows pos[t·k + j] over j."""
    if use_triton:
        return gather_sum(y.contiguous(), pos, top_k)
    rows = y.index_select(0, pos)
    return rows.view(-1, top_k, rows.shape[1]).sum(1)


class PermuteFunction(torch.autograd.Function):
    """xs[p] = x[token[p]]; backward dx[t] = Σ_j dxs[pos[t·k + j]] (the combine's forward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, token: torch.Tensor, pos: torch.Tensor, top_k: int, use_triton: bool) -> torch.Tensor:
        ctx.save_for_backward(pos)
        ctx.top_k, ctx.use_triton = top_k, use_triton
        return _spread_slots(x, token, pos, top_k, use_triton)

    @staticmethod
    def backward(ctx, dxs: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        (pos,) = ctx.saved_tensors
        return _sum_slots(dxs, pos, ctx.top_k, ctx.use_triton), None, None, None, None


class CombineFunction(torch.autograd.Function):
    """out[t] = Σ_j y[pos[t·k + j]]; backward dy[p] = dout[token[p]] (the permutation's forward). Only the index
    vectors are saved: the gates were applied before the experts' down projection."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, token: torch.Tensor, pos: torch.Tensor, top_k: int, use_triton: bool
                ) -> torch.Tensor:
        ctx.save_for_backward(token, pos)
        ctx.top_k, ctx.use_triton = top_k, use_triton
        return _sum_slots(y, pos, top_k, use_triton)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        token, pos = ctx.saved_tensors
        return _spread_slots(dout, token, pos, ctx.top_k, ctx.use_triton), None, None, None, None


class SpreadGroupedMMFunction(torch.autograd.Function):
    """h = grouped_mm(permute(x), w): the experts' first GEMM reading the tokens through the permutation. Given the
    ``GradSink`` x was ``sinked`` with, the gather-sum that makes x's gradient adds it there. Unless
    ``keep_rows``, saves the tokens `[T, d]` (alive anyway: the router's input) instead of their permuted copy
    `[T·k, d]`, and spreads that copy again in the backward for the weight gradient: one copy of T·k rows against
    keeping them from the forward to the backward (1 GiB per MoE layer at 131K tokens, top-4, d = 1024). Where that
    memory is free (a recomputed layer keeps them only from its recompute to its backward) or to spare, keeping
    them saves the copy (81 ms of an 8k step on the H200 as a gather, 2026-12-06)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, pos: torch.Tensor,  # noqa: ANN001
                top_k: int, backend: str, keep_rows: bool, sink: GradSink | None) -> torch.Tensor:
        rows = spread_rows(x, pos, top_k)
        ctx.save_for_backward(rows if keep_rows else x, w, offs, pos)
        ctx.top_k, ctx.backend, ctx.keep_rows, ctx.sink = top_k, backend, keep_rows, sink
        return grouped_mm_nograd(rows, w, offs, backend)

    @staticmethod
    def backward(ctx, dh: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        saved, w, offs, pos = ctx.saved_tensors
        dh = dh.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dxs = grouped_mm_nograd(dh, w.transpose(-2, -1), offs, ctx.backend)
            sink = ctx.sink
            if sink is None:
                dx = gather_sum(dxs, pos, ctx.top_k)
            else:
                sink.grad = gather_sum(dxs, pos, ctx.top_k, into=sink.grad)
        if ctx.needs_input_grad[1]:
            rows = saved if ctx.keep_rows else spread_rows(saved, pos, ctx.top_k)
            dw = grouped_wgrad_nograd(rows, dh, offs, ctx.backend)
        return dx, dw, None, None, None, None, None, None


def spread_grouped_mm(x: torch.Tensor, w: torch.Tensor, plan: RoutingPlan, backend: str, keep_rows: bool = False,
                      sink: GradSink | None = None) -> torch.Tensor:
    """`grouped_mm(permute(x, plan), w, plan.offs)` for x `[T, d]`, w `[E, d, N]` -> `[T·k, N]` in expert order,
    keeping the permuted rows for the backward only if ``keep_rows``, and x's gradient added into ``sink`` if x was
    ``sinked`` with it (``SpreadGroupedMMFunction``); the loop backend (the reference) composes the two
    differentiable ops (x's gradient through autograd)."""
    backend = resolve_backend(backend, x)
    if backend == "loop":
        return loop_grouped_mm(permute(x, plan, backend), w, plan.offs)
    return SpreadGroupedMMFunction.apply(x, w, plan.offs, plan.pos, plan.top_k, backend, keep_rows, sink)


def permute(x: torch.Tensor, plan: RoutingPlan, backend: str = "auto") -> torch.Tensor:
    """Copy x `[T, d]` into expert order -> `[T·k, d]` (one row per slot). Both ways run in Triton (the spread
    forward, the gather-sum backward) unless backend resolves to the loop reference."""
    return PermuteFunction.apply(x, plan.token, plan.pos, plan.top_k, resolve_backend(backend, x) != "loop")


def combine(y: torch.Tensor, plan: RoutingPlan, backend: str = "auto") -> torch.Tensor:
    """Sum of each token's k expert outputs: y `[T·k, d]` (expert order, already weighted by the gates) -> `[T, d]`."""
    return CombineFunction.apply(y, plan.token, plan.pos, plan.top_k, resolve_backend(backend, y) != "loop")
