"""Backward: the reverse state pass (dh, dv_new), then two parallel kernels: one per chunk and head for what
reduces over V (dv, the Gram gradients dA_qk and dA_kk), one per K block for dq, dk, dg.

Writing X = diag(beta) (V - K exp(G) S), so that v_new = Ainv X, the gradient through the UT inverse is
    dX = Ainv^T dv_new,  dA_kk = -dX v_new^T  (strictly lower),
which needs reductions over V only; the gated Gram matrices then backpropagate with the same sub-chunk anchors as
the forward pass. Every place G enters is exp(+G_i) (q, and k as a reader) or exp(-G_j) (k as a writer), so
dG = q dq + k dk_read - k dk_write, and dg is its reverse cumulative sum plus the chunk-end term.

In bf16 runs at K = 128 the Gram gradients are stored in bf16 and their products take bf16 operands
(``gram_precision``): the dq/dk/dg kernel reads each ``[64, 64]`` tile once per sub-chunk anchor and pass, 16
times, so in float32 those reads were most of its traffic. Both sides of dG's cancellation read the same stored
tile and the same rounded operands, so the rounding does not break it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.chunk_intra import (anchor_columns, gram_dot, gram_operand, gram_precision, gram_reads,
                                     own_anchor_rows, sub_chunk_anchor, sub_chunk_rows)
from kernels.kda.chunk_fwd import STATE_PASS_SPACE, chain_bucket
from kernels.kda.gate import load_log_decay, log_decay_grad
from kernels.tuning import autotune, fit_v


@triton.jit
def chunk_kda_decay_kernel(
    q, k, g, A_log, dt_bias, qg, kd, gam, chunks,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, G_MIN: tl.constexpr,
):
    """q exp(G), k exp(gamma - G) and gamma per chunk for the reverse state pass, so it does no scans or exps on
    its chain (the forward's come from the intra kernel; recomputing them here is cheaper than keeping them)."""
    i_t, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0 = tl.load(chunks + 2 * i_t).to(tl.int64)
    te = tl.load(chunks + 2 * i_t + 1).to(tl.int64)
    rows = t0 + tl.arange(0, BT)
    m_t = rows < te
    o_k = i_k * BK + tl.arange(0, BK)
    p_k = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
    b_g = load_log_decay(g + p_k, m_t, A_log, dt_bias, i_h, o_k, K, USE_GATE, HAS_BIAS, G_MIN)
    b_G = tl.cumsum(b_g, 0)
    b_gam = tl.sum(b_g, 0)
    b_q = tl.load(q + p_k, mask=m_t[:, None], other=0.).to(tl.float32)
    b_k = tl.load(k + p_k, mask=m_t[:, None], other=0.).to(tl.float32)
    tl.store(qg + p_k, (b_q * tl.exp(b_G)).to(qg.dtype.element_ty), mask=m_t[:, None])
    tl.store(kd + p_k, (b_k * tl.exp(b_gam[None, :] - b_G)).to(kd.dtype.element_ty), mask=m_t[:, None])
    tl.store(gam + (i_t.to(tl.int64) * H + i_h) * K + o_k, b_gam)


def chunk_kda_decay(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, gate: tuple, chunks: torch.Tensor, chunk: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qg = q exp(G), kd = k exp(gamma - G) [1, T, H, K] (q's dtype) and gamma [NT, H, K] float32."""
    _, T, H, K = q.shape
    A_log, dt_bias, g_min = gate
    qg, kd = torch.empty_like(q), torch.empty_like(k)
    gam = q.new_empty(chunks.shape[0], H, K, dtype=torch.float32)
    BK = min(K, 64)
    chunk_kda_decay_kernel[(chunks.shape[0], H, K // BK)](
        q, k, g, A_log, dt_bias, qg, kd, gam, chunks, H=H, K=K, BT=chunk, BK=BK,
        USE_GATE=A_log is not None, HAS_BIAS=dt_bias is not None, G_MIN=g_min, num_warps=4,
    )
    return qg, kd, gam


@autotune(STATE_PASS_SPACE, key=["H", "K", "V", "CHAINS", "BT"],
          prune_configs_by={"early_config_prune": fit_v})
@triton.jit
def chunk_kda_bwd_dh_kernel(
    qg, kd, gam, w, Aqk, do, dvn, dh, dht, dh0, cu_seqlens, chunk_offsets, order, scale, CHAINS,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, STAGES: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr,
):
    i_v, i_h = tl.program_id(0), tl.program_id(1) % H
    i_n = tl.load(order + tl.program_id(1) // H)
    i_nh = i_n * H + i_h
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    NT = tl.cdiv(eos - bos, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_s = o_k[:, None] * V + o_v[None, :]
    dt = w.dtype.element_ty

    b_dS = tl.zeros([K, BV], dtype=tl.float32)
    if USE_DHT:
        b_dS += tl.load(dht + i_nh.to(tl.int64) * K * V + p_s).to(tl.float32)
    for i_r in tl.range(0, NT, num_stages=STAGES):
        i_t = NT - 1 - i_r
        rows = bos + i_t * BT + o_t
        m_t = rows < eos
        tl.store(dh + ((c0 + i_t) * H + i_h) * K * V + p_s, b_dS.to(dh.dtype.element_ty))
        p_k = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        p_v = rows[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_kd = tl.load(kd + p_k, mask=m_t[:, None], other=0.)
        b_qg = tl.load(qg + p_k, mask=m_t[:, None], other=0.)
        b_gam = tl.load(gam + ((c0 + i_t) * H + i_h) * K + o_k)
        b_w = tl.load(w + p_k, mask=m_t[:, None], other=0.)
        b_A = tl.load(Aqk + rows[:, None] * (H * BT) + i_h * BT + o_t[None, :], mask=m_t[:, None], other=0.)
        b_do = tl.load(do + p_v, mask=m_t[:, None], other=0.).to(dt)

        b_dvn = tl.dot(tl.trans(b_A.to(dt)), b_do, input_precision=PREC) * scale
        b_dvn += tl.dot(b_kd, b_dS.to(dt), input_precision=PREC)
        tl.store(dvn + p_v, b_dvn.to(dvn.dtype.element_ty), mask=m_t[:, None])
        b_dS = b_dS * tl.exp(b_gam)[:, None] + tl.dot(tl.trans(b_qg), b_do, input_precision=PREC) * scale
        b_dS -= tl.dot(tl.trans(b_w), b_dvn.to(dt), input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + p_s, b_dS)


@triton.jit
def load_v_tiles(do, vn, dvn, p_v, m_t, dt: tl.constexpr):
    """The chunk's dO, v_new and dv_new tiles at offsets p_v in dtype dt, zero past the document end."""
    m = m_t[:, None]
    return (tl.load(do + p_v, mask=m, other=0.).to(dt), tl.load(vn + p_v, mask=m, other=0.).to(dt),
            tl.load(dvn + p_v, mask=m, other=0.).to(dt))


@triton.jit
def gram_grad(p, m):
    """A Gram-gradient tile as stored (bf16 or float32: ``gram_precision``), zero where not m."""
    return tl.load(p, mask=m, other=0.)


DA_SPACE = [({"BV": 32}, 4), ({"BV": 64}, 4), ({"BV": 64}, 8)]
# Narrow K blocks keep the [BT, BK] gradient tiles in registers; nothing is repeated across K blocks but the loads
# of dO, v_new and dv_new. BK = 16 at 4 warps is the one 4-warp config that ptxas (sm_90) fits without spills
# (218 registers) since dG's Gram terms keep their products apart. Spills are not what decides, by the autotuner's
# own timings on the H200 at 8 x 8K (2026-12-06): BV 64 / BK 32 at 4 warps 4.30-4.52 ms a call (the pick; 364 B
# spilled), BV 32 / BK 32 at 4 warps 4.32-4.64, BK 64 at 8 warps 5.74-5.92, BK 16 at 4 warps 5.87-6.57, BV 64 /
# BK 32 at 8 warps (no spills) 6.88-7.09. Each program loads the chunk's [64, 64] float32 Gram gradients 16 times:
# loading each once a pass (4 loads, fewer spills) was 1.22x slower on an H100 (BENCHMARKS.md, 2026-12-07). The
# last entry is for chunks of 32: BV 64 / BK 16 capped at 168 registers spills nothing there (162), three programs a
# multiprocessor (at 64: 72 B spilled, two).
DQKG_SPACE = [({"BV": 32, "BK": 32}, 4), ({"BV": 64, "BK": 32}, 4), ({"BV": 64, "BK": 32}, 8),
              ({"BV": 64, "BK": 64}, 8), ({"BV": 32, "BK": 16}, 4), ({"BV": 64, "BK": 16}, 4, 168)]
DQKG_MIN_BK = min(entry[0]["BK"] for entry in DQKG_SPACE)


@autotune(DA_SPACE, key=["H", "V", "BT"],
          prune_configs_by={"early_config_prune": fit_v})
@triton.jit
def chunk_kda_bwd_dA_kernel(
    v, beta, Ainv, vn, dvn, do, dv, dAqk, dAkk, dbeta, chunks, scale,
    T, H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, SLOT: tl.constexpr, PREC: tl.constexpr,
):
    """Everything that reduces over V alone, once per chunk and head: dX = Ainv^T dv_new, dv = beta dX, the beta
    gradient through X, and the gated Gram gradients dA_qk = scale dO v_new^T, dA_kk = -dX v_new^T (bf16 or float32:
    ``gram_precision``)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(chunks + 2 * i_t).to(tl.int64)
    te = tl.load(chunks + 2 * i_t + 1).to(tl.int64)
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    m_t = rows < te
    dt = vn.dtype.element_ty
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.).to(tl.float32)
    p_A = rows[:, None] * (H * BT) + i_h * BT + o_t[None, :]
    b_Tt = tl.trans(tl.load(Ainv + p_A, mask=m_t[:, None], other=0.).to(dt))

    b_dAqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_dAkk = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbv = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        p_v = rows[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_do, b_vn, b_dvn = load_v_tiles(do, vn, dvn, p_v, m_t, dt)
        b_v = tl.load(v + p_v, mask=m_t[:, None], other=0.).to(tl.float32)
        b_dx = tl.dot(b_Tt, b_dvn, input_precision=PREC)
        tl.store(dv + p_v, (b_dx * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_t[:, None])
        b_dbv += tl.sum(b_dx * b_v, 1)
        b_vnt = tl.trans(b_vn)
        b_dAqk += tl.dot(b_do, b_vnt, input_precision=PREC)
        b_dAkk += tl.dot(b_dx.to(dt), b_vnt, input_precision=PREC)
    ga = dAqk.dtype.element_ty
    tl.store(dAqk + p_A, tl.where(o_t[:, None] >= o_t[None, :], b_dAqk * scale, 0.).to(ga), mask=m_t[:, None])
    tl.store(dAkk + p_A, tl.where(o_t[:, None] > o_t[None, :], -b_dAkk, 0.).to(ga), mask=m_t[:, None])
    tl.store(dbeta + SLOT * T * H + rows * H + i_h, b_dbv, mask=m_t)


@autotune(DQKG_SPACE, key=["H", "K", "V", "BT"], restore_value=["dbeta"],
          prune_configs_by={"early_config_prune": fit_v})
@triton.jit
def chunk_kda_bwd_dqkg_kernel(
    q, k, g, beta, A_log, dt_bias, Ainv, vn, dvn, do, h, dh, dAqk, dAkk, dq, dk, dg, dbeta, chunks, scale,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, G_MIN: tl.constexpr,
    PREC: tl.constexpr, GRAM: tl.constexpr,
):
    """dq, dk, dg (or dz) and the rest of dbeta for one K block: the state products, then the gated Gram
    matrices' gradients with the forward's sub-chunk anchors. A chunk's K blocks are neighbouring programs (the
    grid's fastest axis), so the dO, v_new, dv_new, Ainv and Gram-gradient tiles they all read come from L2 after
    the first (with K blocks slowest, each block re-read them from HBM: about 1.6 of some 4 GB a call at 8 × 8K)."""
    NK: tl.constexpr = K // BK
    i_t, i_h, i_k = tl.program_id(0) // NK, tl.program_id(1), tl.program_id(0) % NK
    t0 = tl.load(chunks + 2 * i_t).to(tl.int64)
    te = tl.load(chunks + 2 * i_t + 1).to(tl.int64)
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    m_t = rows < te
    o_k = i_k * BK + tl.arange(0, BK)
    dt = vn.dtype.element_ty
    p_h = (i_t.to(tl.int64) * H + i_h) * K * V

    b_dqs = tl.zeros([BT, BK], dtype=tl.float32)   # dO S^T
    b_Q = tl.zeros([BT, BK], dtype=tl.float32)     # dv_new S^T (dX S^T = Ainv^T dv_new S^T)
    b_dkd = tl.zeros([BT, BK], dtype=tl.float32)   # v_new dS'^T
    b_dgam = tl.zeros([BK], dtype=tl.float32)      # sum_v S * dS'
    for i_v in range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        p_v = rows[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_do, b_vn, b_dvn = load_v_tiles(do, vn, dvn, p_v, m_t, dt)
        p_s = p_h + o_k[:, None] * V + o_v[None, :]
        b_S = tl.load(h + p_s).to(dt)
        b_dS = tl.load(dh + p_s).to(dt)
        b_St = tl.trans(b_S)
        b_dqs += tl.dot(b_do, b_St, input_precision=PREC)
        b_Q += tl.dot(b_dvn, b_St, input_precision=PREC)
        b_dkd += tl.dot(b_vn, tl.trans(b_dS), input_precision=PREC)
        b_dgam += tl.sum(b_S.to(tl.float32) * b_dS.to(tl.float32), 1)

    p_A = rows[:, None] * (H * BT) + i_h * BT + o_t[None, :]
    p_At = rows[None, :] * (H * BT) + i_h * BT + o_t[:, None]   # the transposed tile, read as such
    b_P = tl.dot(tl.trans(tl.load(Ainv + p_A, mask=m_t[:, None], other=0.).to(tl.float32)), b_Q,
                 input_precision=PREC)
    p_k = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
    b_G = tl.cumsum(load_log_decay(g + p_k, m_t, A_log, dt_bias, i_h, o_k, K, USE_GATE, HAS_BIAS, G_MIN), 0)
    b_gam = sub_chunk_anchor(b_G, BT // BC, BT, BC)   # the whole chunk's log-decay
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.).to(tl.float32)
    b_k = tl.load(k + p_k, mask=m_t[:, None], other=0.).to(tl.float32)

    # The Gram products: per sub-chunk anchor a, dA [BT, BT] times k exp(c_a - G) (columns up to a's end, rounded
    # here as the product reads it, so both sides below see the same operand), kept on a's rows; every row is
    # rescaled around its own anchor afterwards (E = exp(G - c_a(i))). dq = scale dO S^T exp(G) + E D_qk, and through
    # X = diag(beta) (V - K exp(G) S), X's gradient -exp(G) P + E D_kk (then dk as a reader).
    b_Dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_Dk = tl.zeros([BT, BK], dtype=tl.float32)
    for a in range(BT // BC):
        b_kc = gram_operand(b_k * anchor_columns(b_G, a, BT, BC), GRAM)
        m_a = sub_chunk_rows(a, BT, BC)
        b_Dq += tl.where(m_a, gram_dot(gram_grad(dAqk + p_A, m_t[:, None]), b_kc, GRAM), 0.)
        b_Dk += tl.where(m_a, gram_dot(gram_grad(dAkk + p_A, m_t[:, None]), b_kc, GRAM), 0.)
    b_eG = tl.exp(b_G)
    b_E = own_anchor_rows(b_G, BT, BC)
    b_q = tl.load(q + p_k, mask=m_t[:, None], other=0.).to(tl.float32)
    b_dqs = b_dqs * scale * b_eG
    tl.store(dq + p_k, (b_dqs + b_E * b_Dq).to(dq.dtype.element_ty), mask=m_t[:, None])
    b_X = b_E * b_Dk - b_eG * b_P
    tl.store(dbeta + i_k * T * H + rows * H + i_h, tl.sum(b_k * b_X, 1), mask=m_t)
    b_dk = b_beta[:, None] * b_X                        # dk_read
    # dG = q dq + k dk_read - k dk_write. The Gram parts cancel between rows and columns (their sum over the chunk is
    # zero), so each is formed from the same rounded operands on both sides: q exp(G - c_a) and k beta exp(G - c_a)
    # as the column pass reads them, and k exp(c_a - G) as the row pass did. Rounded on one side only, tf32's 2^-11
    # tripled dg's error in bf16 against the recurrence (GPU: 8.6e-3, fla-core 2.8e-3).
    b_qr = gram_reads(b_q * b_E, GRAM)
    b_kbr = gram_reads(b_k * b_beta[:, None] * b_E, GRAM)
    b_dG = b_q * b_dqs - b_k * b_beta[:, None] * b_eG * b_P + b_qr * b_Dq + b_kbr * b_Dk

    # dk as a writer: through k exp(gamma - G) in the state update and k_j exp(-G_j) in both Gram matrices.
    b_dkw = b_dkd * tl.exp(b_gam[None, :] - b_G)
    b_dgam = b_dgam * tl.exp(b_gam) + tl.sum(b_k * b_dkw, 0)
    b_dG -= b_k * b_dkw
    for a in range(BT // BC):
        e_col = anchor_columns(b_G, a, BT, BC)
        m_a = sub_chunk_rows(a, BT, BC)
        b_w = gram_dot(gram_grad(dAqk + p_At, m_t[None, :]), tl.where(m_a, b_qr, 0.), GRAM)
        b_w += gram_dot(gram_grad(dAkk + p_At, m_t[None, :]), tl.where(m_a, b_kbr, 0.), GRAM)
        b_dkw += e_col * b_w
        b_dG -= gram_reads(b_k * e_col, GRAM) * b_w
    b_dk += b_dkw
    tl.store(dk + p_k, b_dk.to(dk.dtype.element_ty), mask=m_t[:, None])

    b_dg = tl.cumsum(b_dG, 0, reverse=True) + b_dgam[None, :]
    if USE_GATE:
        b_dg *= log_decay_grad(g + p_k, m_t, A_log, dt_bias, i_h, o_k, K, HAS_BIAS, G_MIN)
    tl.store(dg + p_k, b_dg.to(dg.dtype.element_ty), mask=m_t[:, None])


def chunk_kda_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  gate: tuple, saved: dict, do: torch.Tensor, dht: torch.Tensor | None, scale: float, has_h0: bool,
                  cu_seqlens: torch.Tensor, chunk_offsets: torch.Tensor, order: torch.Tensor, chunks: torch.Tensor,
                  prec: str
                  ) -> tuple[torch.Tensor, ...]:
    """dq, dk [1, T, H, K]; dv [1, T, H, V]; dg (or dz) [1, T, H, K]; dbeta [1, T, H] fp32; dh0 [N, H, K, V] or None.

    saved holds the forward's Aqk, Ainv, w, vn (v_new) and h; it is emptied as they stop being needed, so that where
    no one else holds them (activation checkpointing's recompute) A_qk and w are freed before the gradients are
    allocated. Saved tensors are never written: a retained graph can run its backward again.
    """
    Aqk, w, h, vn = saved.pop("Aqk"), saved.pop("w"), saved.pop("h"), saved.pop("vn")
    _, T, H, K = q.shape
    V = v.shape[-1]
    N = cu_seqlens.numel() - 1
    A_log, dt_bias, g_min = gate
    use_gate, has_bias = A_log is not None, dt_bias is not None
    dh = torch.empty_like(h)
    dvn = torch.empty_like(vn)
    dh0 = q.new_empty(N, H, K, V, dtype=torch.float32) if has_h0 else None
    BT = Aqk.shape[-1]
    qg, kd, gam = chunk_kda_decay(q, k, g, gate, chunks, BT)
    chunk_kda_bwd_dh_kernel[lambda meta: (V // meta["BV"], N * H)](
        qg, kd, gam, w, Aqk, do, dvn, dh, dht, dh0, cu_seqlens, chunk_offsets, order, scale, chain_bucket(N * H),
        H=H, K=K, V=V, BT=BT, USE_DHT=dht is not None, STORE_DH0=has_h0, PREC=prec,
    )
    # qg and kd (recomputed here, not saved) are dead now: their memory takes dq and dk.
    dq, dk, dv, dg = qg, kd, torch.empty_like(v), torch.empty_like(g)
    del qg, kd, gam, Aqk, w
    Ainv = saved.pop("Ainv")
    slots = K // DQKG_MIN_BK   # one partial dbeta per K block of the narrowest config, and one for the V part
    dbeta = q.new_zeros(slots + 1, T, H, dtype=torch.float32)
    gram = gram_precision(q.dtype, prec, K)
    dAqk = q.new_empty(1, T, H, BT, dtype=torch.bfloat16 if gram == "bf16" else torch.float32)
    dAkk = torch.empty_like(dAqk)
    chunk_kda_bwd_dA_kernel[(chunks.shape[0], H)](
        v, beta, Ainv, vn, dvn, do, dv, dAqk, dAkk, dbeta, chunks, scale, T, H=H, V=V, BT=BT, SLOT=slots, PREC=prec,
    )
    chunk_kda_bwd_dqkg_kernel[lambda meta: (chunks.shape[0] * (K // meta["BK"]), H)](
        q, k, g, beta, A_log, dt_bias, Ainv, vn, dvn, do, h, dh, dAqk, dAkk, dq, dk, dg, dbeta, chunks, scale,
        T, H=H, K=K, V=V, BT=BT, BC=16, USE_GATE=use_gate, HAS_BIAS=has_bias, G_MIN=g_min, PREC=prec,
        GRAM=gram,
    )
    return dq, dk, dv, dg, dbeta.sum(0, keepdim=True), dh0
