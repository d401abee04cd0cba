"""SwiGLU activation on the fused gate|up projection: `a = silu(h[:, :F]) * h[:, F:]`, optionally times a per-row
scale `s` (the routed experts' gates: applied here, before the down projection, the combine needs no expert outputs
saved for the gates' gradient, which is `Σ_c da · silu(g) · u` per row instead).

One Triton pass each way over blocks of rows (fp32 math, the gate's sigmoid recomputed in backward instead of
stored, the scale's gradient summed per row in registers); plain PyTorch on the loop (reference) path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .grouped_gemm import resolve_backend

# Per program and column block: rows = ELEMENTS // the column block. At 4096 the backward spilled (ptxas, sm_90,
# d_expert 224); at 2048 it uses 168 registers and spills nothing (`python -m kernels.ptxas_report`).
ELEMENTS, MAX_COLUMNS, WARPS = 2048, 1024, 4


@triton.jit
def gate_up_block(h_ptr, rows, m_r, c0, F_DIM, BF: tl.constexpr):
    """Columns c0 … c0 + BF of the rows: their indices, mask, offsets in h, and the gate and up halves in fp32."""
    cols = c0 + tl.arange(0, BF)
    m = m_r[:, None] & (cols < F_DIM)[None, :]
    off = rows[:, None] * 2 * F_DIM + cols[None, :]
    g = tl.load(h_ptr + off, mask=m, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + off + F_DIM, mask=m, other=0.0).to(tl.float32)
    return cols, m, off, g, u


@triton.jit
def swiglu_fwd_kernel(h_ptr, s_ptr, a_ptr, M, F_DIM, SCALED: tl.constexpr, BR: tl.constexpr, BF: tl.constexpr):
    """a[r, c] = silu(h[r, c]) * h[r, F + c] (* s[r] if SCALED) for the program's BR rows."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = rows < M
    if SCALED:
        s = tl.load(s_ptr + rows, mask=m_r, other=0.0)
    for c0 in range(0, F_DIM, BF):
        cols, m, off, g, u = gate_up_block(h_ptr, rows, m_r, c0, F_DIM, BF)
        a = g * tl.sigmoid(g) * u
        if SCALED:
            a = a * s[:, None]
        tl.store(a_ptr + rows[:, None] * F_DIM + cols[None, :], a.to(a_ptr.dtype.element_ty), mask=m)


@triton.jit
def swiglu_bwd_kernel(h_ptr, s_ptr, da_ptr, dh_ptr, ds_ptr, M, F_DIM, SCALED: tl.constexpr, BR: tl.constexpr,
                      BF: tl.constexpr):
    """dh = [d·u·σ(g)(1 + g(1 − σ(g))), d·g·σ(g)] for the gate and up halves, d = da (· s[r] if SCALED), and
    ds[r] = Σ_c da · silu(g) · u."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = rows < M
    if SCALED:
        s = tl.load(s_ptr + rows, mask=m_r, other=0.0)
        ds = tl.zeros([BR], dtype=tl.float32)
    for c0 in range(0, F_DIM, BF):
        cols, m, off, g, u = gate_up_block(h_ptr, rows, m_r, c0, F_DIM, BF)
        da = tl.load(da_ptr + rows[:, None] * F_DIM + cols[None, :], mask=m, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        if SCALED:
            ds += tl.sum(da * g * sig * u, 1)
            da = da * s[:, None]
        tl.store(dh_ptr + off, (da * u * sig * (1.0 + g * (1.0 - sig))).to(dh_ptr.dtype.element_ty), mask=m)
        tl.store(dh_ptr + off + F_DIM, (da * g * sig).to(dh_ptr.dtype.element_ty), mask=m)
    if SCALED:
        tl.store(ds_ptr + rows, ds, mask=m_r)


def _blocks(f_dim: int) -> dict[str, int]:
    bf = min(triton.next_power_of_2(max(f_dim, 1)), MAX_COLUMNS)
    return dict(BR=max(1, ELEMENTS // bf), BF=bf)


def swiglu_fwd(h: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """h `[M, 2F]` contiguous, scale fp32 `[M]` or None -> a `[M, F]`."""
    m, f_dim = h.shape[0], h.shape[1] // 2
    a = torch.empty(m, f_dim, dtype=h.dtype, device=h.device)
    if a.numel():
        blocks = _blocks(f_dim)
        swiglu_fwd_kernel[(triton.cdiv(m, blocks["BR"]),)](h, h if scale is None else scale, a, m, f_dim,
                                                           SCALED=scale is not None, **blocks, num_warps=WARPS)
    return a


def swiglu_bwd(h: torch.Tensor, da: torch.Tensor, scale: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h `[M, 2F]`, da `[M, F]`, scale fp32 `[M]` or None -> dh `[M, 2F]` and the scale's gradient fp32 `[M]`
    (None without a scale)."""
    m, f_dim = da.shape
    dh = torch.empty_like(h)
    ds = torch.empty(m, dtype=torch.float32, device=h.device) if scale is not None else None
    if da.numel():
        blocks = _blocks(f_dim)
        swiglu_bwd_kernel[(triton.cdiv(m, blocks["BR"]),)](
            h, h if scale is None else scale, da, dh, h if ds is None else ds, m, f_dim, SCALED=scale is not None,
            **blocks, num_warps=WARPS)
    elif ds is not None:
        ds.zero_()
    return dh, ds


class SwiGLUFunction(torch.autograd.Function):
    """Saves only h (and the scale); the activation is recomputed inside the backward kernel."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:  # noqa: ANN001
        h = h.contiguous()
        scale = None if scale is None else scale.contiguous()
        ctx.save_for_backward(h, scale)
        return swiglu_fwd(h, scale)

    @staticmethod
    def backward(ctx, da: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # noqa: ANN001
        h, scale = ctx.saved_tensors
        dh, ds = swiglu_bwd(h, da.contiguous(), scale)
        return dh, (ds.to(scale.dtype) if ds is not None and ctx.needs_input_grad[1] else None)


def swiglu(h: torch.Tensor, backend: str = "auto", scale: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU of h `[M, 2F]` (gate columns first) -> `[M, F]`, same dtype, each row times `scale[r]` when given
    (fp32 `[M]`, differentiable). The Triton kernel runs unless the (grouped GEMM) backend resolves to the plain
    per-expert loop."""
    if scale is not None and scale.shape != (h.shape[0],):
        raise ValueError(f"scale: expected one value per row of h, shape ({h.shape[0]},), got {tuple(scale.shape)}")
    if resolve_backend(backend, h) != "loop":
        return SwiGLUFunction.apply(h, scale)
    gate, up = h.chunk(2, dim=-1)
    a = F.silu(gate) * up
    return a if scale is None else (a.float() * scale[:, None]).to(a.dtype)
