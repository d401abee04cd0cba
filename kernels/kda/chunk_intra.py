"""Intra-chunk forward: gated Gram matrices A_qk, A_kk on 16-token sub-chunk blocks, the UT inverse, and w, u.

A chunk of BT = 64 tokens is four sub-chunks of BC = 16. The rows of sub-chunk a are rescaled around c_a, the
cumulative log-decay just before it (never a later token, so the chunk stays exactly causal):
    A[i, j] = sum_c (x_ic exp(G_ic - c_a)) (k_jc exp(c_a - G_jc)),   i in sub-chunk a, j <= its last token.
With g >= -5 the row exponent lies in [-80, 0] and the column one is <= 80 (it only underflows where the product
does), so each row sub-chunk is one [16, K] x [K, 64] `tl.dot`, diagonal block included.

Three phases in one program: the chunk's keys and cumulative decay [64, K] are loaded and scanned once; the Gram
rows go to A_qk and, as L = diag(beta) strict_tril(A_kk), to a float32 scratch; after a barrier L comes back as one
[64, 64] tile for the UT inverse; w and u follow from the inverse still in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.gate import load_log_decay
from kernels.kda.tuning import configs, fit_v

# (BV, num_warps): the keys and their cumulative decay [64, K] stay in registers through the Gram phase.
# Smallest block first: the interpreter runs only the first entry, for every V.
INTRA_SPACE = [({"BV": 32}, 8), ({"BV": 64}, 8), ({"BV": 128}, 8), ({"BV": 64}, 4)]


@triton.jit
def sub_chunk_anchor(b_G, a, BT: tl.constexpr, BC: tl.constexpr):
    """c_a [BK]: the chunk's cumulative log-decay b_G [BT, BK] just before sub-chunk a (0 for the first; the whole
    chunk's decay for a = BT // BC), read out exactly."""
    return tl.sum(tl.where((tl.arange(0, BT) == a * BC - 1)[:, None], b_G, 0.), 0)


@triton.jit
def anchor_exponents(b_G, a, BT: tl.constexpr, BC: tl.constexpr):
    """exp(G - c_a) on the rows of sub-chunk a (else 0) and exp(c_a - G) on tokens up to its end (else 0)."""
    o_t = tl.arange(0, BT)
    b_c = sub_chunk_anchor(b_G, a, BT, BC)
    m_row = (o_t >= a * BC) & (o_t < a * BC + BC)
    m_col = o_t < a * BC + BC
    e_row = tl.exp(tl.where(m_row[:, None], b_G - b_c[None, :], float("-inf")))
    e_col = tl.exp(tl.where(m_col[:, None], b_c[None, :] - b_G, float("-inf")))
    return e_row, e_col


@triton.jit
def load_rows(x, row0, te, i_h, o_x, H: tl.constexpr, X: tl.constexpr, R: tl.constexpr):
    """Rows row0 .. row0 + R of a [T, H, X] tensor at columns o_x in float32, zero past the document end."""
    rows = row0 + tl.arange(0, R)
    m = rows < te
    return tl.load(x + rows[:, None] * (H * X) + i_h * X + o_x[None, :], mask=m[:, None], other=0.).to(tl.float32)


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
def gram_rows(q, k, g, A_log, dt_bias, beta, Aqk, L, b_k, b_G, t0, te, i_h, a,
              H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
              USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, G_MIN: tl.constexpr, PREC: tl.constexpr):
    """Rows of sub-chunk a of A_qk (stored, lower incl.) and of L = diag(beta) strict_tril(A_kk) (to the scratch),
    from the chunk's keys b_k and cumulative log-decay b_G [BT, K]."""
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, K)
    r0 = t0 + a * BC
    rows = r0 + o_c
    m_r = rows < te
    b_c = sub_chunk_anchor(b_G, a, BT, BC)
    b_kct = tl.trans(b_k * tl.exp(tl.where((o_t < a * BC + BC)[:, None], b_c[None, :] - b_G, float("-inf"))))
    b_er = tl.exp(tl.cumsum(load_log_decay(g + rows[:, None] * (H * K) + i_h * K + o_k[None, :], m_r,
                                           A_log, dt_bias, i_h, o_k, K, USE_GATE, HAS_BIAS, G_MIN), 0))
    b_Aq = tl.dot(load_rows(q, r0, te, i_h, o_k, H, K, BC) * b_er, b_kct, input_precision=PREC)
    b_Ak = tl.dot(load_rows(k, r0, te, i_h, o_k, H, K, BC) * b_er, b_kct, input_precision=PREC)
    i_loc = a * BC + o_c
    b_beta = tl.load(beta + rows * H + i_h, mask=m_r, other=0.).to(tl.float32)
    p = rows[:, None] * (H * BT) + i_h * BT + o_t[None, :]
    tl.store(Aqk + p, tl.where(i_loc[:, None] >= o_t[None, :], b_Aq, 0.).to(Aqk.dtype.element_ty), mask=m_r[:, None])
    tl.store(L + p, tl.where(i_loc[:, None] > o_t[None, :], b_Ak * b_beta[:, None], 0.), mask=m_r[:, None])


@triton.autotune(configs(INTRA_SPACE), key=["H", "K", "V"], prune_configs_by={"early_config_prune": fit_v})
@triton.jit
def chunk_kda_fwd_intra_kernel(
    q, k, v, g, beta, A_log, dt_bias, Aqk, L, Ainv, w, u, chunks,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, G_MIN: tl.constexpr, PREC: tl.constexpr,
    SOLVE_PREC: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(chunks + 2 * i_t).to(tl.int64)
    te = tl.load(chunks + 2 * i_t + 1).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    rows = t0 + o_t
    m_t = rows < te
    p_k = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
    # The chunk's keys and cumulative log-decay, loaded and scanned once for all four sub-chunks.
    b_k = load_rows(k, t0, te, i_h, o_k, H, K, BT)
    b_G = tl.cumsum(load_log_decay(g + p_k, m_t, A_log, dt_bias, i_h, o_k, K, USE_GATE, HAS_BIAS, G_MIN), 0)
    for a in range(BT // BC):
        gram_rows(q, k, g, A_log, dt_bias, beta, Aqk, L, b_k, b_G, t0, te, i_h, a, H, K, BT, BC,
                  USE_GATE, HAS_BIAS, G_MIN, PREC)
    tl.debug_barrier()   # L's rows, written by every warp, are read back as one tile

    p_A = rows[:, None] * (H * BT) + i_h * BT + o_t[None, :]
    b_T = solve_unit_lower(tl.load(L + p_A, mask=m_t[:, None], other=0.), BT, BC, SOLVE_PREC)
    tl.store(Ainv + p_A, b_T.to(Ainv.dtype.element_ty), mask=m_t[:, None])

    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.).to(tl.float32)
    # Loaded and scanned again rather than kept alive through the inverse (registers).
    b_G = tl.cumsum(load_log_decay(g + p_k, m_t, A_log, dt_bias, i_h, o_k, K, USE_GATE, HAS_BIAS, G_MIN), 0)
    b_kb = load_rows(k, t0, te, i_h, o_k, H, K, BT) * tl.exp(b_G) * b_beta[:, None]
    tl.store(w + p_k, tl.dot(b_T, b_kb, input_precision=PREC).to(w.dtype.element_ty), mask=m_t[:, None])
    for i_v in tl.static_range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        p_v = rows[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_vb = load_rows(v, t0, te, i_h, o_v, H, V, BT) * b_beta[:, None]
        tl.store(u + p_v, tl.dot(b_T, b_vb, input_precision=PREC).to(u.dtype.element_ty), mask=m_t[:, None])


def chunk_kda_fwd_intra(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        gate: tuple, chunks: torch.Tensor, prec: tuple[str, str]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Aqk, Ainv [1, T, H, 64] and w [1, T, H, K], u [1, T, H, V] for flattened q, k, g [1, T, H, K]."""
    _, T, H, K = q.shape
    V = v.shape[-1]
    A_log, dt_bias, g_min = gate
    a_dtype = torch.float32 if q.dtype == torch.float32 else q.dtype
    Aqk = q.new_empty(1, T, H, 64, dtype=a_dtype)
    L = q.new_empty(1, T, H, 64, dtype=torch.float32)   # scratch: only alive during the kernel
    Ainv = torch.empty_like(Aqk)
    w = torch.empty_like(k)
    u = torch.empty_like(v)
    chunk_kda_fwd_intra_kernel[(chunks.shape[0], H)](
        q, k, v, g, beta, A_log, dt_bias, Aqk, L, Ainv, w, u, chunks,
        H=H, K=K, V=V, BT=64, BC=16,
        USE_GATE=A_log is not None, HAS_BIAS=dt_bias is not None, G_MIN=g_min, PREC=prec[0], SOLVE_PREC=prec[1],
    )
    return Aqk, Ainv, w, u
