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
def stack_rows(b0, b1, b2, b3):
    """Four [BC, N] row blocks -> [4 BC, N], block a on rows a BC .. a BC + BC - 1 (register shuffles only)."""
    b_j = tl.join(tl.join(b0, b1), tl.join(b2, b3))  # [BC, N, 2, 2]: [r, c, j, i] = block 2 i + j
    b_j = tl.permute(b_j, (3, 2, 0, 1))
    return tl.reshape(b_j, (4 * b0.shape[0], b0.shape[1]))


@triton.jit
def row_block_exponents(p_g, rows, te, A_log, dt_bias, i_h, o_k, b_g, b_G, K: tl.constexpr,
                        BT: tl.constexpr, a: tl.constexpr, BC: tl.constexpr, USE_GATE: tl.constexpr,
                        HAS_BIAS: tl.constexpr, G_MIN: tl.constexpr):
    """For row sub-chunk a: exp(G_i - c_a) on its BC rows [BC, BK] (a local cumulative sum of its own gates, read
    again from memory) and exp(c_a - G_j) on the chunk's tokens up to its end [BT, BK] (0 after), from the chunk's
    gates b_g [BT, BK] and their cumulative sums b_G."""
    o_t = tl.arange(0, BT)
    b_c = tl.sum(tl.where((o_t < a * BC)[:, None], b_g, 0.), 0)
    e_col = tl.exp(tl.where((o_t < a * BC + BC)[:, None], b_c[None, :] - b_G, float("-inf")))
    m_a = rows < te
    b_ga = load_log_decay(p_g, m_a, A_log, dt_bias, i_h, o_k, K, USE_GATE, HAS_BIAS, G_MIN)
    e_row = tl.exp(tl.cumsum(b_ga, 0))
    return e_row, e_col


@triton.jit
def gram_rows(q, k, g, A_log, dt_bias, b_k, b_g, b_G, t0, te, i_h, o_k, H: tl.constexpr,
              K: tl.constexpr, BT: tl.constexpr, a: tl.constexpr, BC: tl.constexpr, USE_GATE: tl.constexpr,
              HAS_BIAS: tl.constexpr, G_MIN: tl.constexpr, PREC: tl.constexpr):
    """Row block a [BC, BT] of the gated Gram matrices q (k e)^T and k (k e)^T over one K block (no masks)."""
    rows = t0 + a * BC + tl.arange(0, BC)
    p_a = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
    e_row, e_col = row_block_exponents(g + p_a, rows, te, A_log, dt_bias, i_h, o_k, b_g, b_G, K, BT, a, BC,
                                       USE_GATE, HAS_BIAS, G_MIN)
    m_a = (rows < te)[:, None]
    b_qa = tl.load(q + p_a, mask=m_a, other=0.).to(tl.float32) * e_row
    b_ka = tl.load(k + p_a, mask=m_a, other=0.).to(tl.float32) * e_row
    b_kc = tl.trans(b_k * e_col)
    return tl.dot(b_qa, b_kc, input_precision=PREC), tl.dot(b_ka, b_kc, input_precision=PREC)


@triton.jit
def solve_unit_lower(b_L, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """(I + L)^-1 for strictly lower L [BT, BT] (BT = 4 BC).

    The diagonal BC-blocks D = (I + L_d)^-1 by forward substitution, all four blocks at once in float32 FMAs (row r
    of every block per step: the exact arithmetic of substitution, no tensor cores); then (I + L)^-1 = (I + N)^-1 D
    with N = D L_o strictly block-lower, by Horner with dots (T <- D - N T, exact after three steps).
    """
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    o_b = tl.arange(0, 4)
    blk = o_t // BC
    eye4 = (o_b[:, None] == o_b[None, :])[:, None, :, None]
    b_Ld = tl.sum(tl.where(eye4, tl.reshape(b_L, (4, BC, 4, BC)), 0.), 2)  # [4, BC, BC]: the diagonal blocks
    b_X = tl.where((o_c[:, None] == o_c[None, :])[None, :, :], 1., 0.) + tl.zeros([4, BC, BC], dtype=tl.float32)
    for r in tl.static_range(1, BC):
        at_r = (o_c == r)[None, :, None]
        b_lr = tl.sum(tl.where(at_r, b_Ld, 0.), 1)                 # [4, BC]: row r of each block
        b_xr = tl.sum(b_lr[:, :, None] * b_X, 1)                  # [4, BC]: sum_j L[r, j] X[j, :]
        b_X = tl.where(at_r, b_X - b_xr[:, None, :], b_X)
    b_D = tl.reshape(tl.where(eye4, b_X[:, :, None, :], 0.), (BT, BT))
    b_N = tl.dot(b_D, tl.where(blk[:, None] > blk[None, :], b_L, 0.), input_precision=PREC)
    b_T = b_D
    for _ in tl.static_range(3):
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
    o_c = tl.arange(0, BC)
    rows = t0 + o_t
    m_t = rows < te
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.).to(tl.float32)

    # Row blocks a of A_qk and A_kk: each is one [BC, BK] x [BK, BT] product per K block (no masked rows).
    b_q0 = tl.zeros([BC, BT], dtype=tl.float32)
    b_q1, b_q2, b_q3 = b_q0, b_q0, b_q0
    b_k0, b_k1, b_k2, b_k3 = b_q0, b_q0, b_q0, b_q0
    for i_k in tl.static_range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        p_k = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_k = tl.load(k + p_k, mask=m_t[:, None], other=0.).to(tl.float32)
        b_g = load_log_decay(g + p_k, m_t, A_log, dt_bias, i_h, o_k, K, USE_GATE, HAS_BIAS, G_MIN)
        b_G = tl.cumsum(b_g, 0)
        x_q, x_k = gram_rows(q, k, g, A_log, dt_bias, b_k, b_g, b_G, t0, te, i_h, o_k, H, K, BT, 0, BC,
                             USE_GATE, HAS_BIAS, G_MIN, PREC)
        b_q0, b_k0 = b_q0 + x_q, b_k0 + x_k
        x_q, x_k = gram_rows(q, k, g, A_log, dt_bias, b_k, b_g, b_G, t0, te, i_h, o_k, H, K, BT, 1, BC,
                             USE_GATE, HAS_BIAS, G_MIN, PREC)
        b_q1, b_k1 = b_q1 + x_q, b_k1 + x_k
        x_q, x_k = gram_rows(q, k, g, A_log, dt_bias, b_k, b_g, b_G, t0, te, i_h, o_k, H, K, BT, 2, BC,
                             USE_GATE, HAS_BIAS, G_MIN, PREC)
        b_q2, b_k2 = b_q2 + x_q, b_k2 + x_k
        x_q, x_k = gram_rows(q, k, g, A_log, dt_bias, b_k, b_g, b_G, t0, te, i_h, o_k, H, K, BT, 3, BC,
                             USE_GATE, HAS_BIAS, G_MIN, PREC)
        b_q3, b_k3 = b_q3 + x_q, b_k3 + x_k
    b_Aqk = tl.where(o_t[:, None] >= o_t[None, :], stack_rows(b_q0, b_q1, b_q2, b_q3), 0.)
    b_Akk = tl.where(o_t[:, None] > o_t[None, :], stack_rows(b_k0, b_k1, b_k2, b_k3) * b_beta[:, None], 0.)
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
