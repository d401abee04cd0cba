"""The bounded KDA gate g = g_min * sigmoid(exp(A) * (z + dt_bias)): a PyTorch form and the in-kernel loaders.

Computing g inside the kernels from the raw z (bf16) avoids materialising g in float32, and guarantees the bound
g in (g_min, 0) that lets every sub-chunk block run on tensor cores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def kda_gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None, g_min: float) -> torch.Tensor:
    """g = g_min * sigmoid(exp(A_log[h]) * (z + dt_bias[h, k])) in float32; z [B, T, H, K], A_log [H], dt_bias [H*K]."""
    H, K = z.shape[-2:]
    x = z.float() if dt_bias is None else z.float() + dt_bias.float().view(H, K)
    return g_min * torch.sigmoid(A_log.float().exp()[:, None] * x)


@triton.jit
def load_log_decay(p_g, m_t, A_log, dt_bias, i_h, o_k, K: tl.constexpr,
                   USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, G_MIN: tl.constexpr):
    """Log-decay tile [BT, BK] in float32, zero on rows past the document end (so cumulative sums stop there)."""
    b_z = tl.load(p_g, mask=m_t[:, None], other=0.).to(tl.float32)
    if USE_GATE:
        if HAS_BIAS:
            b_z += tl.load(dt_bias + i_h * K + o_k).to(tl.float32)[None, :]
        b_z = G_MIN * tl.sigmoid(tl.exp(tl.load(A_log + i_h).to(tl.float32)) * b_z)
    return tl.where(m_t[:, None], b_z, 0.)


@triton.jit
def log_decay_grad(p_g, m_t, A_log, dt_bias, i_h, o_k, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                   G_MIN: tl.constexpr):
    """dg/dz of the bounded gate, tile [BT, BK] in float32."""
    b_z = tl.load(p_g, mask=m_t[:, None], other=0.).to(tl.float32)
    if HAS_BIAS:
        b_z += tl.load(dt_bias + i_h * K + o_k).to(tl.float32)[None, :]
    b_a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    b_s = tl.sigmoid(b_a * b_z)
    return G_MIN * b_s * (1. - b_s) * b_a
