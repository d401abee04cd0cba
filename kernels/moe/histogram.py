"""The quantile balancer's residual histogram: counts of `r_ij = α_i − s_ij` per expert over `n_bins` bins.

The bins span `[min(b) − 1, max(b) + 1]`, which holds every residual and is the same on every rank (see
``kernels.moe.balance``). ``residual_histogram`` is the definition in PyTorch; on a GPU it took several passes over
`[T, E]` tensors per MoE layer and micro-batch (the residuals in float32, the bins and the expert offsets in int64, a
tensor of ones) and a `scatter_add` of T·E int64 ones: on the 8k stage, 304 calls a step, and `scatter_add` alone
86 ms of the step's profile (2026-12-05, H100). ``add_residual_histogram`` is one Triton kernel instead: it reads the
scores once and adds each residual's bin into the running counts with an atomic add, so the micro-batches of a step
sum in place and no `[T, E]` tensor is written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grouped_gemm import interpreting
from .permute import expert_counts

ROWS = 32  # rows per program: 32 x 128 float32 scores, 4,096 atomic adds


def histogram_bins(bias: torch.Tensor, n_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, width)`` of the n_bins bins over `[min(b) − 1, max(b) + 1]`: the range covers every residual, and is the
    same on every rank. The width is divided by a tensor, not the int: PyTorch on CUDA multiplies by the float32
    reciprocal of a host scalar divisor, a width one ulp off the division's (the kernel's), and bins that differed at
    their edges by the device they were counted on."""
    lo, hi = bias.min() - 1.0, bias.max() + 1.0
    return lo, (hi - lo) / torch.full_like(hi, n_bins)


def residual_histogram(residuals: torch.Tensor, bias: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Counts int64 `[E, n_bins]` of residuals `[N, E]` over `histogram_bins(bias, n_bins)` (the reference)."""
    lo, width = histogram_bins(bias, n_bins)
    bins = ((residuals - lo) / width).long().clamp_(0, n_bins - 1)
    n_experts = residuals.shape[1]
    flat = bins + torch.arange(n_experts, device=bins.device) * n_bins
    return expert_counts(flat, n_experts * n_bins).view(n_experts, n_bins)


@triton.jit
def residual_histogram_kernel(scores, alpha, bias, hist, T, E: tl.constexpr, EP: tl.constexpr, N_BINS: tl.constexpr,
                              BT: tl.constexpr):
    """hist[j, bin(α_i − s_ij)] += 1 for the program's BT rows, the bins as ``residual_histogram`` computes them
    (IEEE division, truncation toward zero, then clamped)."""
    o_t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    o_e = tl.arange(0, EP)
    m_t, m_e = o_t < T, o_e < E
    b_b = tl.load(bias + o_e, mask=m_e, other=0.)
    lo = tl.min(tl.where(m_e, b_b, float("inf")), 0) - 1.0
    hi = tl.max(tl.where(m_e, b_b, float("-inf")), 0) + 1.0
    width = tl.math.div_rn(hi - lo, tl.full([], N_BINS, tl.float32))
    m = m_t[:, None] & m_e[None, :]
    b_r = tl.load(alpha + o_t, mask=m_t, other=0.)[:, None] - tl.load(scores + o_t[:, None] * E + o_e[None, :],
                                                                        mask=m, other=0.)
    b_bin = tl.math.div_rn(b_r - lo, tl.zeros_like(b_r) + width).to(tl.int64)
    b_bin = tl.minimum(tl.maximum(b_bin, 0), N_BINS - 1)
    tl.atomic_add(hist + o_e[None, :] * N_BINS + b_bin, tl.full([BT, EP], 1, tl.int64), mask=m, sem="relaxed")


def add_residual_histogram(hist: torch.Tensor, scores: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor) -> None:
    """``hist += residual_histogram(alpha[:, None] − scores, bias, n_bins)`` in place: hist int64 `[E, n_bins]`,
    scores float32 `[T, E]`, alpha float32 `[T]`, bias float32 `[E]`. The kernel on CUDA and under the interpreter,
    the reference elsewhere."""
    n_experts, n_bins = hist.shape
    if not (scores.is_cuda or interpreting()):
        hist += residual_histogram(alpha.unsqueeze(1) - scores, bias, n_bins)
        return
    T = scores.shape[0]
    if T:
        residual_histogram_kernel[(triton.cdiv(T, ROWS),)](
            scores.float().contiguous(), alpha.float().contiguous(), bias.float().contiguous(), hist, T,
            E=n_experts, EP=triton.next_power_of_2(n_experts), N_BINS=n_bins, BT=ROWS, num_warps=8)
