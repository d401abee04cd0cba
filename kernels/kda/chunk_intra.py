"""Intra-chunk forward: gated Gram matrices A_qk, A_kk with sub-chunk anchors, the UT inverse, and w, u.

Within a chunk of BT = 64 tokens, row sub-chunk a (BC = 16 tokens) is rescaled around c_a, the cumulative
log-decay just before it (never a later token, so the chunk stays exactly causal):
    A[i, j] = sum_c (x_ic exp(G_ic - c_a)) (k_jc exp(c_a - G_jc)).
With g >= -5 both exponents lie within 16 * 5 = 80 of zero, so every block, diagonal ones included, is one
dense `tl.dot`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.gate import load_log_decay


@triton.jit
def anchor_exponents(b_g, b_G, a: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """exp(G - c_a) on the rows of sub-chunk a (else 0) and exp(c_a - G) on tokens up to its end (else 0)."""
    o_t = tl.arange(0, BT)
    b_c = tl.sum(tl.where((o_t < a * BC)[:, None], b_g, 0.), 0)
    m_row = (o_t >= a * BC) & (o_t < a * BC + BC)
    m_col = o_t < a * BC + BC
    e_row = tl.exp(tl.where(m_row[:, None], b_G - b_c[None, :], float("-inf")))
    e_col = tl.exp(tl.where(m_col[:, None], b_c[None, :] - b_G, float("-inf")))
    return e_row, e_col


@triton.jit
def solve_unit_lower(b_L, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """(I + L)^-1 for strictly lower L [BT, BT], with dots only.

    Diagonal BC-blocks D = (I + L_d)^-1 by the Horner form of the Neumann series on the stacked [BT, BC] blocks
    (X <- E - L_d X; local row r is exact after r steps, the arithmetic of forward substitution, so no large powers
    of L appear); then (I + L)^-1 = (I + N)^-1 D with N = D L_o strictly block-lower, again by Horner (T <- D - N T).
    """
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    blk = o_t // BC
    same = blk[:, None] == blk[None, :]
    b_E = tl.where((o_t % BC)[:, None] == o_c[None, :], 1., 0.)
    b_Ld = tl.where(same, b_L, 0.)
    b_X = b_E
    for _ in range(BC - 1):
        b_X = b_E - tl.dot(b_Ld, b_X, input_precision=PREC)
    # Spread the stacked blocks onto the diagonal: one nonzero per sum, so exact in float32.
    b_P = tl.where(o_c[:, None] == (o_t % BC)[None, :], 1., 0.)
    b_D = tl.where(same, tl.dot(b_X, b_P, input_precision="ieee"), 0.)
    b_N = tl.dot(b_D, tl.where(blk[:, None] > blk[None, :], b_L, 0.), input_precision=PREC)
    b_T = b_D
    for _ in range(BT // BC - 1):
        b_T = b_D - tl.dot(b_N, b_T, input_precision=PREC)
    return b_T


@triton.jit
def chunk_kda_fwd_intra_kernel(
    q, k, v, g, beta, A_log, dt_bias, Aqk, Ainv, w, u, chunks,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, G_MIN: tl.constexpr, PREC: tl.constexpr,
    SOLVE_PREC: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(chunks + 2 * i_t).to(tl.int64)
    te = tl.load(chunks + 2 * i_t + 1).to(tl.int64)
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    m_t = rows < te
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.).to(tl.float32)

    b_Aqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_Akk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in tl.static_range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        p_k = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_q = tl.load(q + p_k, mask=m_t[:, None], other=0.).to(tl.float32)
        b_k = tl.load(k + p_k, mask=m_t[:, None], other=0.).to(tl.float32)
        b_g = load_log_decay(g + p_k, m_t, A_log, dt_bias, i_h, o_k, K, USE_GATE, HAS_BIAS, G_MIN)
        b_G = tl.cumsum(b_g, 0)
        for a in tl.static_range(BT // BC):
            e_row, e_col = anchor_exponents(b_g, b_G, a, BT, BC)
            b_kc = tl.trans(b_k * e_col)
            b_Aqk += tl.dot(b_q * e_row, b_kc, input_precision=PREC)
            b_Akk += tl.dot(b_k * e_row, b_kc, input_precision=PREC)
    b_Aqk = tl.where(o_t[:, None] >= o_t[None, :], b_Aqk, 0.)
    b_Akk = tl.where(o_t[:, None] > o_t[None, :], b_Akk * b_beta[:, None], 0.)
    b_T = solve_unit_lower(b_Akk, BT, BC, SOLVE_PREC)

    p_A = rows[:, None] * (H * BT) + i_h * BT + o_t[None, :]
    tl.store(Aqk + p_A, b_Aqk.to(Aqk.dtype.element_ty), mask=m_t[:, None])
    tl.store(Ainv + p_A, b_T.to(Ainv.dtype.element_ty), mask=m_t[:, None])
    for i_k in tl.static_range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        p_k = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_k = tl.load(k + p_k, mask=m_t[:, None], other=0.).to(tl.float32)
        b_g = load_log_decay(g + p_k, m_t, A_log, dt_bias, i_h, o_k, K, USE_GATE, HAS_BIAS, G_MIN)
        b_kb = b_k * tl.exp(tl.cumsum(b_g, 0)) * b_beta[:, None]
        b_w = tl.dot(b_T, b_kb, input_precision=PREC)
        tl.store(w + p_k, b_w.to(w.dtype.element_ty), mask=m_t[:, None])
    for i_v in tl.static_range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        p_v = rows[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_t[:, None], other=0.).to(tl.float32)
        b_u = tl.dot(b_T, b_v * b_beta[:, None], input_precision=PREC)
        tl.store(u + p_v, b_u.to(u.dtype.element_ty), mask=m_t[:, None])


def chunk_kda_fwd_intra(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        gate: tuple, chunks: torch.Tensor, prec: tuple[str, str]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Aqk, Ainv [1, T, H, 64] and w [1, T, H, K], u [1, T, H, V] for flattened q, k, g [1, T, H, K]."""
    _, T, H, K = q.shape
    V = v.shape[-1]
    A_log, dt_bias, g_min = gate
    a_dtype = torch.float32 if q.dtype == torch.float32 else q.dtype
    Aqk = q.new_empty(1, T, H, 64, dtype=a_dtype)
    Ainv = torch.empty_like(Aqk)
    w = torch.empty_like(k)
    u = torch.empty_like(v)
    chunk_kda_fwd_intra_kernel[(chunks.shape[0], H)](
        q, k, v, g, beta, A_log, dt_bias, Aqk, Ainv, w, u, chunks,
        H=H, K=K, V=V, BT=64, BC=16, BK=min(K, 64), BV=min(V, 64),
        USE_GATE=A_log is not None, HAS_BIAS=dt_bias is not None, G_MIN=g_min, PREC=prec[0], SOLVE_PREC=prec[1],
        num_warps=8,
    )
    return Aqk, Ainv, w, u
