"""Grouped expert GEMM: rows sorted by expert, one weight matrix per expert.

`grouped_mm(x, w, offs)` computes `y[r] = x[r] @ w[e(r)]` where the rows of expert `e` are
`offs[e-1]:offs[e]` (`offs` is the inclusive cumulative row count, int32, like `torch._grouped_mm`).
Backends: Triton kernels (forward, input gradient and weight gradient), `torch._grouped_mm`
(CUTLASS, Hopper, bf16) and a per-expert loop of plain matmuls (the reference, and the CPU path).
"""
from __future__ import annotations

import os
from typing import Literal

import torch
import triton
import triton.language as tl

Backend = Literal["auto", "triton", "torch", "loop"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch", "loop")


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """Pick the concrete backend for `x`: torch's CUTLASS grouped GEMM for bf16 on Hopper (measured
    faster, see BENCHMARKS.md), Triton elsewhere on CUDA and under the interpreter, else the loop."""
    if backend != "auto":
        return backend
    if x.is_cuda:
        hopper = torch.cuda.get_device_capability(x.device)[0] >= 9
        if hasattr(torch, "_grouped_mm") and hopper and x.dtype == torch.bfloat16:
            return "torch"
        return "triton"
    return "triton" if interpreting() else "loop"


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands use exact fp32 products (the reference tolerance is 1e-5); tf32 would not pass."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _config(x: torch.Tensor) -> dict[str, int]:
    """Tile shape: tensor-core sized on a GPU, the smallest legal dot in the interpreter (speed)."""
    if x.is_cuda and x.dtype == torch.float32:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}
    if x.is_cuda:  # fastest of the sweep in BENCHMARKS.md (forward x·w13 on H200)
        return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 1, "num_stages": 1}


def _wgrad_config(x: torch.Tensor) -> dict[str, int]:
    """Weight-gradient tiles: BLOCK_M is the reduction step here, BLOCK_K x BLOCK_N the output tile."""
    if x.is_cuda and x.dtype == torch.float32:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
    if x.is_cuda:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}
    return _config(x)


@triton.jit
def grouped_mm_kernel(
    x_ptr, w_ptr, y_ptr, tile_expert_ptr, tile_start_ptr, offs_ptr,
    N, K,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_ym, stride_yn,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y; every M tile lies inside one expert's rows."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m)
    if e >= 0:
        start = tl.load(tile_start_ptr + pid_m)
        end = tl.load(offs_ptr + e)
        rm = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mask_m = rm < end
        mask_n = rn < N
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk
        w_ptrs = w_ptr + e.to(tl.int64) * stride_we + rk[:, None] * stride_wk + rn[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, tl.cdiv(K, BLOCK_K)):
            mask_k = rk < K - k0 * BLOCK_K
            a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def grouped_wgrad_kernel(
    x_ptr, dy_ptr, dw_ptr, offs_ptr,
    K, N,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_dwe, stride_dwk, stride_dwn,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_K, BLOCK_N] tile of dw[e] = x[rows of e]ᵀ @ dy[rows of e]; empty experts get 0."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    pid_k = pid // n_tiles_n
    pid_n = pid % n_tiles_n
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offs_ptr + e)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_k = rk < K
    mask_n = rn < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rm = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask_m = rm < end
        a = tl.load(x_ptr + rm[None, :] * stride_xm + rk[:, None] * stride_xk,
                    mask=mask_k[:, None] & mask_m[None, :], other=0.0)
        b = tl.load(dy_ptr + rm[:, None] * stride_dym + rn[None, :] * stride_dyn,
                    mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    dw_ptrs = dw_ptr + e.to(tl.int64) * stride_dwe + rk[:, None] * stride_dwk + rn[None, :] * stride_dwn
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])


def tile_schedule(offs: torch.Tensor, n_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Map each M tile to (expert, first row) on the device, without a host sync.

    The grid is sized by the bound `cdiv(n_rows, block_m) + E`; tiles past the last expert get
    expert -1 and do nothing. Returns `tile_expert`, `tile_start`: int32 `[n_tiles]`.
    """
    n_experts = offs.numel()
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    t = torch.arange(triton.cdiv(n_rows, block_m) + n_experts, device=offs.device)
    expert = torch.searchsorted(tile_end, t, right=True)
    e = expert.clamp(max=n_experts - 1)
    start = ends[e] - counts[e] + (t - (tile_end[e] - tiles[e])) * block_m
    tile_expert = torch.where(expert < n_experts, e, -1)
    return tile_expert.to(torch.int32), start.to(torch.int32)


def grouped_mm_fwd(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, cfg: dict[str, int] | None = None) -> torch.Tensor:
    """Triton launch: x `[M, K]` (rows sorted by expert), w `[E, K, N]` (any strides) -> `[M, N]`.
    cfg overrides the tile shape (the benchmark's sweep)."""
    n_rows, k = x.shape
    n = w.shape[2]
    y = torch.empty(n_rows, n, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return y
    cfg = cfg or _config(x)
    tile_expert, tile_start = tile_schedule(offs, n_rows, cfg["BLOCK_M"])
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), tile_expert.numel())
    grouped_mm_kernel[grid](
        x, w, y, tile_expert, tile_start, offs, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0), y.stride(1),
        PRECISION=_dot_precision(x.dtype), **cfg,
    )
    return y


def grouped_mm_wgrad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Triton launch: weight gradient `[E, K, N]` from x `[M, K]` and dy `[M, N]`."""
    k, n = x.shape[1], dy.shape[1]
    n_experts = offs.numel()
    dw = torch.empty(n_experts, k, n, dtype=x.dtype, device=x.device)
    cfg = _wgrad_config(x)
    grid = (triton.cdiv(k, cfg["BLOCK_K"]) * triton.cdiv(n, cfg["BLOCK_N"]), n_experts)
    grouped_wgrad_kernel[grid](
        x, dy, dw, offs, k, n,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
        PRECISION=_dot_precision(x.dtype), **cfg,
    )
    return dw


class GroupedMMFunction(torch.autograd.Function):
    """Triton grouped GEMM with its two backward GEMMs (dx uses w transposed through strides)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        return grouped_mm_fwd(x, w, offs)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_mm_fwd(dy, w.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
        dw = grouped_mm_wgrad(x, dy, offs) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_mm_nograd(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, backend: str) -> torch.Tensor:
    """`y[r] = x[r] @ w[e(r)]` outside autograd, for a Function that writes its own backward: torch's CUTLASS
    kernel or ours ("torch" or "triton"). `w` may be a transposed view (the input gradient's `wᵀ`)."""
    if backend == "torch":
        return torch._grouped_mm(x, w, offs=offs)
    return grouped_mm_fwd(x, w, offs)


def grouped_wgrad_nograd(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, backend: str) -> torch.Tensor:
    """Weight gradient `[E, K, N]`: `xᵀ dy` over each expert's rows of x `[M, K]` and dy `[M, N]`, as torch's own
    backward of `_grouped_mm` computes it ("torch"), or by our kernel ("triton")."""
    if backend == "torch":
        return torch._grouped_mm(x.t(), dy, offs=offs)
    return grouped_mm_wgrad(x, dy, offs)


def loop_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Reference: one plain matmul per expert (syncs on `offs`)."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    return torch.cat([x[s:t] @ w[e] for e, (s, t) in enumerate(zip(starts, ends))], dim=0)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """Grouped GEMM `y[r] = x[r] @ w[e(r)]`, differentiable in x and w.

    x `[M, K]` with rows sorted by expert, w `[E, K, N]`, offs int32 `[E]` (cumulative row ends,
    `offs[-1] == M`). Returns `[M, N]` in x's dtype.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [M, K] and w [E, K, N], got x {tuple(x.shape)} and w {tuple(w.shape)}")
    if offs.dtype != torch.int32 or offs.shape != (w.shape[0],):
        raise ValueError(f"offs must be int32 [{w.shape[0]}], got {offs.dtype} {tuple(offs.shape)}")
    return _grouped_mm(x, w, offs, resolve_backend(backend, x))


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, backend: str) -> torch.Tensor:
    """Unchecked dispatch to a concrete backend (the layer calls this after its own checks)."""
    if backend == "torch":
        return torch._grouped_mm(x, w, offs=offs)
    if backend == "triton":
        return GroupedMMFunction.apply(x, w, offs)
    return loop_grouped_mm(x, w, offs)
