"""SwiGLU activation on the fused gate|up projection: `a = silu(h[:, :F]) * h[:, F:]`.

One Triton pass each way (fp32 math, the gate's sigmoid recomputed in backward instead of stored);
plain PyTorch on the loop (reference) path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .grouped_gemm import resolve_backend

BLOCK = 1024


@triton.jit
def swiglu_fwd_kernel(h_ptr, a_ptr, n_elem, F_DIM, BLOCK: tl.constexpr):
    """a[r, c] = silu(h[r, c]) * h[r, F + c] over the flattened `[M, F]` output."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n_elem
    row = idx // F_DIM
    col = idx % F_DIM
    g = tl.load(h_ptr + row * 2 * F_DIM + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * 2 * F_DIM + F_DIM + col, mask=mask, other=0.0).to(tl.float32)
    a = g * tl.sigmoid(g) * u
    tl.store(a_ptr + idx, a.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(h_ptr, da_ptr, dh_ptr, n_elem, F_DIM, BLOCK: tl.constexpr):
    """dh = [da·u·σ(g)(1 + g(1 − σ(g))), da·g·σ(g)] for the gate and up halves."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n_elem
    row = idx // F_DIM
    col = idx % F_DIM
    g_off = row * 2 * F_DIM + col
    g = tl.load(h_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + g_off + F_DIM, mask=mask, other=0.0).to(tl.float32)
    da = tl.load(da_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    dg = da * u * sig * (1.0 + g * (1.0 - sig))
    du = da * g * sig
    tl.store(dh_ptr + g_off, dg.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + g_off + F_DIM, du.to(dh_ptr.dtype.element_ty), mask=mask)


def swiglu_fwd(h: torch.Tensor) -> torch.Tensor:
    """h `[M, 2F]` contiguous -> a `[M, F]`."""
    f_dim = h.shape[1] // 2
    a = torch.empty(h.shape[0], f_dim, dtype=h.dtype, device=h.device)
    n_elem = a.numel()
    if n_elem:
        swiglu_fwd_kernel[(triton.cdiv(n_elem, BLOCK),)](h, a, n_elem, f_dim, BLOCK=BLOCK)
    return a


def swiglu_bwd(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """h `[M, 2F]`, da `[M, F]` -> dh `[M, 2F]`."""
    dh = torch.empty_like(h)
    n_elem = da.numel()
    if n_elem:
        swiglu_bwd_kernel[(triton.cdiv(n_elem, BLOCK),)](h, da, dh, n_elem, h.shape[1] // 2, BLOCK=BLOCK)
    return dh


class SwiGLUFunction(torch.autograd.Function):
    """Saves only h; the activation is recomputed inside the backward kernel."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        h = h.contiguous()
        ctx.save_for_backward(h)
        return swiglu_fwd(h)

    @staticmethod
    def backward(ctx, da: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        return swiglu_bwd(h, da.contiguous())


def swiglu(h: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """SwiGLU of h `[M, 2F]` (gate columns first) -> `[M, F]`, same dtype. The Triton kernel runs
    unless the (grouped GEMM) backend resolves to the plain per-expert loop."""
    if resolve_backend(backend, h) != "loop":
        return SwiGLUFunction.apply(h)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up
