"""The bounded KDA gate g = g_min * sigmoid(exp(A) * (z + dt_bias)): a PyTorch form, the in-kernel loaders, and
its parameters' gradients.

Computing g inside the kernels from the raw z (bf16) avoids materialising g in float32, and guarantees the bound
g in (g_min, 0) that lets every sub-chunk block run on tensor cores. The parameters' gradients are sums over every
token of dz (the kernels' gradient of z): ``dA_log[h] = Σ dz (z + dt_bias)``, ``d dt_bias[h, k] = Σ dz``. In PyTorch
they took five full-size float32 passes (two casts, the add, the product, the sums: about 40 bytes moved per
element, 250-280 ms of a ``small`` 8k step on the H100, 2026-12-05); one Triton pass reads dz and z once.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Rows per program of the parameter-gradient pass (its partial sums are one [K] row per program and head) and rows
# per tile within it.
GRAD_ROWS, GRAD_BT = 1024, 32


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


def naive_gate_param_grads(dz: torch.Tensor, z: torch.Tensor, dt_bias: torch.Tensor | None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """dA_log [H] = Σ dz (z + dt_bias) and d dt_bias [H*K] = Σ dz over every token, float32; dz, z [1, T, H, K]."""
    H, K = z.shape[-2:]
    x = z.float() if dt_bias is None else z.float() + dt_bias.float().view(H, K)
    ds = dz.float()
    return (ds * x).sum((0, 1, 3)), ds.sum((0, 1)).reshape(-1)


@triton.jit
def gate_param_grads_kernel(dz, z, dt_bias, dA, db, T, H: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                            ROWS: tl.constexpr, BT: tl.constexpr):
    """Partial sums over the program's ROWS tokens for head i_h: dA[p, h] and db[p, h, :]."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, K)
    b_bias = tl.load(dt_bias + i_h * K + o_k).to(tl.float32) if HAS_BIAS else tl.zeros([K], dtype=tl.float32)
    b_dA = tl.zeros([K], dtype=tl.float32)
    b_db = tl.zeros([K], dtype=tl.float32)
    for r in range(ROWS // BT):
        o_t = i_p.to(tl.int64) * ROWS + r * BT + tl.arange(0, BT)
        m = (o_t < T)[:, None]
        p = (o_t[:, None] * H + i_h) * K + o_k[None, :]
        b_dz = tl.load(dz + p, mask=m, other=0.).to(tl.float32)
        b_x = tl.load(z + p, mask=m, other=0.).to(tl.float32) + b_bias[None, :]
        b_dA += tl.sum(b_dz * b_x, 0)
        b_db += tl.sum(b_dz, 0)
    tl.store(dA + i_p * H + i_h, tl.sum(b_dA, 0))
    tl.store(db + (i_p * H + i_h) * K + o_k, b_db)


def gate_param_grads(dz: torch.Tensor, z: torch.Tensor, dt_bias: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``naive_gate_param_grads`` in one pass over dz and z (Triton on CUDA and under ``TRITON_INTERPRET=1``, the
    PyTorch form elsewhere): per program and head, partial sums in float32, then summed over the programs."""
    if not (z.is_cuda or INTERPRET):
        return naive_gate_param_grads(dz, z, dt_bias)
    _, T, H, K = z.shape
    programs = triton.cdiv(T, GRAD_ROWS)
    dA = torch.empty(programs, H, dtype=torch.float32, device=z.device)
    db = torch.empty(programs, H, K, dtype=torch.float32, device=z.device)
    gate_param_grads_kernel[(programs, H)](dz.contiguous(), z.contiguous(), dt_bias if dt_bias is not None else dA,
                                           dA, db, T, H=H, K=K, HAS_BIAS=dt_bias is not None, ROWS=GRAD_ROWS,
                                           BT=GRAD_BT)
    return dA.sum(0), db.sum(0).reshape(-1)
