"""Intra-chunk forward: gated Gram matrices A_qk, A_kk on 16-token sub-chunk blocks, the UT inverse, and w, u.

A chunk of BT = 64 tokens is four sub-chunks of BC = 16 (BT = 32: two). The rows of sub-chunk a are rescaled
around c_a, the cumulative log-decay just before it (never a later token, so the chunk stays exactly causal):
    A[i, j] = sum_c (x_ic exp(G_ic - c_a)) (k_jc exp(c_a - G_jc)),   i in sub-chunk a, j <= its last token.
With g >= -5 the row exponent lies in [-80, 0] and the column one is <= 80 (it only underflows where the product
does), so every block, diagonal included, runs on tensor cores.

One program per chunk and head, no scratch: for each K block, each anchor's rows [BT, BK] (zero outside its
sub-chunk) times the keys up to its end accumulate into full [BT, BT] tiles of A_qk and A_kk in registers; A_qk is
stored, L = diag(beta) strict_tril(A_kk) is inverted in registers by recursive doubling, and w, u follow from the
inverse. The masked full tiles do BT / 16 times the Gram FLOPs of [16, K] row blocks but keep A_kk in one register
tile for the inverse (the row-block form went through a global scratch and a barrier, and was slower on the H200).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.gate import load_log_decay
from kernels.tuning import autotune, fit_v

# (BK, BV, num_warps[, register cap]). Smallest blocks first: the interpreter runs only the first entry, for every
# K and V. The last two are for chunks of 32 (ptxas, sm_90, K = 128, no spills there): 2 warps at 165 registers,
# six programs a multiprocessor, and BK = BV = 64 capped at 168 registers, three (at 64 they spill 300 and 956 B).
INTRA_SPACE = [({"BK": 32, "BV": 32}, 4), ({"BK": 32, "BV": 64}, 4), ({"BK": 32, "BV": 64}, 8),
               ({"BK": 64, "BV": 64}, 4), ({"BK": 64, "BV": 64}, 8), ({"BK": 64, "BV": 128}, 8),
               ({"BK": 32, "BV": 32}, 2), ({"BK": 64, "BV": 64}, 4, 168)]


@triton.jit
def sub_chunk_anchor(b_G, a, BT: tl.constexpr, BC: tl.constexpr):
    """c_a [BK]: the chunk's cumulative log-decay b_G [BT, BK] just before sub-chunk a (0 for the first; the whole
    chunk's decay for a = BT // BC), read out exactly."""
    return tl.sum(tl.where((tl.arange(0, BT) == a * BC - 1)[:, None], b_G, 0.), 0)


@triton.jit
def sub_chunk_rows(a, BT: tl.constexpr, BC: tl.constexpr):
    """[BT, 1] mask of the rows of sub-chunk a."""
    o_t = tl.arange(0, BT)
    return ((o_t >= a * BC) & (o_t < a * BC + BC))[:, None]


@triton.jit
def anchor_columns(b_G, a, BT: tl.constexpr, BC: tl.constexpr):
    """exp(c_a - G) on tokens up to the end of sub-chunk a (else 0): the column factor of a's rows."""
    m_col = tl.arange(0, BT) < a * BC + BC
    return tl.exp(tl.where(m_col[:, None], sub_chunk_anchor(b_G, a, BT, BC)[None, :] - b_G, float("-inf")))


@triton.jit
def anchor_exponents(b_G, a, BT: tl.constexpr, BC: tl.constexpr):
    """exp(G - c_a) on the rows of sub-chunk a (else 0) and exp(c_a - G) on tokens up to its end (else 0)."""
    b_c = sub_chunk_anchor(b_G, a, BT, BC)
    e_row = tl.exp(tl.where(sub_chunk_rows(a, BT, BC), b_G - b_c[None, :], float("-inf")))
    e_col = tl.exp(tl.where((tl.arange(0, BT) < a * BC + BC)[:, None], b_c[None, :] - b_G, float("-inf")))
    return e_row, e_col


@triton.jit
def own_anchor_rows(b_G, BT: tl.constexpr, BC: tl.constexpr):
    """exp(G - c_a) with a each row's own sub-chunk: the row factor of every anchor's block at once."""
    o_t = tl.arange(0, BT)
    b_C = tl.zeros_like(b_G)
    for a in tl.static_range(1, BT // BC):
        b_C = tl.where((o_t >= a * BC)[:, None], sub_chunk_anchor(b_G, a, BT, BC)[None, :], b_C)
    return tl.exp(b_G - b_C)


@triton.jit
def as_dot_reads(x, PREC: tl.constexpr):
    """x as a `tl.dot` of precision PREC reads it: rounded to tf32 (10-bit mantissa, nearest) for "tf32", else as
    is, so an operand also used outside the dot is the same number the tensor cores multiplied."""
    if PREC == "tf32":
        x = ((x.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return x


@triton.jit
def gram_operand(x, GRAM: tl.constexpr):
    """x as a Gram product's operand: bf16 for GRAM "bf16" (bf16 training: the tensor cores' full rate, and half
    the registers of a float32 operand), else float32 as a dot of precision GRAM reads it (``as_dot_reads``)."""
    if GRAM == "bf16":
        y = x.to(tl.bfloat16)
    else:
        y = as_dot_reads(x, GRAM)
    return y


@triton.jit
def gram_reads(x, GRAM: tl.constexpr):
    """``gram_operand(x)`` in float32: the number the product multiplied, for the same operand's elementwise uses."""
    return gram_operand(x, GRAM).to(tl.float32)


@triton.jit
def gram_dot(a, b, GRAM: tl.constexpr):
    """a b with operands read as ``gram_operand`` reads them, accumulated in float32."""
    if GRAM == "bf16":
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        c = tl.dot(a, b, input_precision=GRAM)
    return c


@triton.jit
def solve_unit_lower(b_L, BT: tl.constexpr, PREC: tl.constexpr):
    """(I + L)^-1 for strictly lower L [BT, BT] (BT a power of two), by recursive doubling of the diagonal blocks.

    With T holding the inverse's diagonal blocks of width m, the blocks of width 2m are T - (T C) T, C being L's
    lower-left m-block inside each 2m-block: the two-block inverse [[A^-1, 0], [-B^-1 C A^-1, B^-1]] of recursive
    triangular inversion. Width 2 is exact without a product, so BT = 64 is five levels of two dependent dots: a
    shorter chain than forward substitution's BT - 1 steps, which is what bounds this kernel's latency.
    """
    o_t = tl.arange(0, BT)
    b_T = tl.where(o_t[:, None] == o_t[None, :], 1., 0.) - tl.where((o_t // 2)[:, None] == (o_t // 2)[None, :], b_L, 0.)
    for i in tl.static_range(1, BT.bit_length() - 1):
        blk, pair = o_t >> i, o_t >> (i + 1)   # the m = 2^i blocks, and the 2m blocks they pair into
        lower_left = (pair[:, None] == pair[None, :]) & (blk[:, None] > blk[None, :])
        b_TC = tl.dot(b_T, tl.where(lower_left, b_L, 0.), input_precision=PREC)
        b_T -= tl.dot(b_TC, b_T, input_precision=PREC)
    return b_T


@autotune(INTRA_SPACE, key=["H", "K", "V", "BT"], prune_configs_by={"early_config_prune": fit_v})
@triton.jit
def chunk_kda_fwd_intra_kernel(
    q, k, v, g, beta, A_log, dt_bias, Aqk, Ainv, w, u, qg, kd, gam, chunks,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, G_MIN: tl.constexpr, PREC: tl.constexpr,
    SOLVE_PREC: tl.constexpr, GRAM: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(chunks + 2 * i_t).to(tl.int64)
    te = tl.load(chunks + 2 * i_t + 1).to(tl.int64)
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    m_t = rows < te

    # Gram matrices over K blocks: per sub-chunk anchor, its rows [BT, BK] (zero elsewhere) times the keys up to its
    # end, accumulated into full [BT, BT] tiles that stay in registers for the inverse.
    b_Aq = tl.zeros([BT, BT], dtype=tl.float32)
    b_Ak = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        p_k = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_G = tl.cumsum(load_log_decay(g + p_k, m_t, A_log, dt_bias, i_h, o_k, K, USE_GATE, HAS_BIAS, G_MIN), 0)
        b_q = tl.load(q + p_k, mask=m_t[:, None], other=0.).to(tl.float32)
        b_k = tl.load(k + p_k, mask=m_t[:, None], other=0.).to(tl.float32)
        for a in range(BT // BC):
            e_row, e_col = anchor_exponents(b_G, a, BT, BC)
            b_kct = tl.trans(gram_operand(b_k * e_col, GRAM))
            b_Aq += gram_dot(b_q * e_row, b_kct, GRAM)
            b_Ak += gram_dot(b_k * e_row, b_kct, GRAM)
    p_A = rows[:, None] * (H * BT) + i_h * BT + o_t[None, :]
    tl.store(Aqk + p_A, tl.where(o_t[:, None] >= o_t[None, :], b_Aq, 0.).to(Aqk.dtype.element_ty),
             mask=m_t[:, None])

    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.).to(tl.float32)
    b_T = solve_unit_lower(tl.where(o_t[:, None] > o_t[None, :], b_Ak * b_beta[:, None], 0.), BT, SOLVE_PREC)
    tl.store(Ainv + p_A, b_T.to(Ainv.dtype.element_ty), mask=m_t[:, None])

    # w = Ainv diag(beta) k exp(G), u = Ainv diag(beta) v, block by block (G scanned again: cheaper than keeping it);
    # with them what the state pass reads, q exp(G), k exp(gamma - G) and gamma (the chunk's decay), from the same
    # tiles instead of a kernel of their own.
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        p_k = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_G = tl.cumsum(load_log_decay(g + p_k, m_t, A_log, dt_bias, i_h, o_k, K, USE_GATE, HAS_BIAS, G_MIN), 0)
        b_eG = tl.exp(b_G)
        b_gam = sub_chunk_anchor(b_G, BT // BC, BT, BC)
        b_k = tl.load(k + p_k, mask=m_t[:, None], other=0.).to(tl.float32)
        b_q = tl.load(q + p_k, mask=m_t[:, None], other=0.).to(tl.float32)
        tl.store(qg + p_k, (b_q * b_eG).to(qg.dtype.element_ty), mask=m_t[:, None])
        tl.store(kd + p_k, (b_k * tl.exp(b_gam[None, :] - b_G)).to(kd.dtype.element_ty), mask=m_t[:, None])
        tl.store(gam + (i_t.to(tl.int64) * H + i_h) * K + o_k, b_gam)
        b_kb = b_k * b_eG * b_beta[:, None]
        tl.store(w + p_k, tl.dot(b_T, b_kb, input_precision=PREC).to(w.dtype.element_ty), mask=m_t[:, None])
    for i_v in range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        p_v = rows[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_vb = tl.load(v + p_v, mask=m_t[:, None], other=0.).to(tl.float32) * b_beta[:, None]
        tl.store(u + p_v, tl.dot(b_T, b_vb, input_precision=PREC).to(u.dtype.element_ty), mask=m_t[:, None])


def gram_precision(dtype: torch.dtype, prec: str, K: int) -> str:
    """The Gram products' operands: bf16 in bf16 runs at K = 128, as fla-core's are not (it multiplies float32 at
    tf32): the dq/dk/dg kernel 0.75x, the intra kernel 0.95x on an H100 (BENCHMARKS.md, 2026-12-07). Under the
    interpreter with a GPU's numerics (T = 1024, K = V = 128, three documents, against the recurrence), bf16
    against tf32 operands: o 3.7e-3 against 2.9e-3, dq 3.7e-3 against 3.0e-3, dg 3.3e-3 against 2.7e-3 (the tests
    allow 5e-3). At K = 64 the bf16 kernels faulted on an H100 (Triton 3.6, 2026-12-07:
    ``test_gpu_bf16_matches_fp32_reference[B2-T2000-H2-K64]``, an illegal memory access; every config passes the
    interpreter's bounds check there), so other head dims keep ``prec``, as float32 runs do (exact in the tests)."""
    return "bf16" if dtype == torch.bfloat16 and K == 128 else prec


def chunk_kda_fwd_intra(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        gate: tuple, chunks: torch.Tensor, prec: tuple[str, str], chunk: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    """Aqk, Ainv [1, T, H, chunk], w [1, T, H, K], u [1, T, H, V] for flattened q, k, g [1, T, H, K] in chunks of
    ``chunk`` tokens (the rows of ``chunks``), and the state pass's decayed inputs (qg = q exp(G), kd = k
    exp(gamma - G) in q's dtype, gamma [NT, H, K] float32)."""
    _, T, H, K = q.shape
    V = v.shape[-1]
    A_log, dt_bias, g_min = gate
    a_dtype = torch.float32 if q.dtype == torch.float32 else q.dtype
    Aqk = q.new_empty(1, T, H, chunk, dtype=a_dtype)
    Ainv = torch.empty_like(Aqk)
    w = torch.empty_like(k)
    u = torch.empty_like(v)
    qg, kd = torch.empty_like(q), torch.empty_like(k)
    gam = q.new_empty(chunks.shape[0], H, K, dtype=torch.float32)
    chunk_kda_fwd_intra_kernel[(chunks.shape[0], H)](
        q, k, v, g, beta, A_log, dt_bias, Aqk, Ainv, w, u, qg, kd, gam, chunks,
        H=H, K=K, V=V, BT=chunk, BC=16,
        USE_GATE=A_log is not None, HAS_BIAS=dt_bias is not None, G_MIN=g_min, PREC=prec[0], SOLVE_PREC=prec[1],
        GRAM=gram_precision(q.dtype, prec[0], K),
    )
    return Aqk, Ainv, w, u, (qg, kd, gam)
