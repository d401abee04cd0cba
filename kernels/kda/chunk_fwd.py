"""Inter-chunk forward: the state recurrence over chunks, fused with the output (and the decayed q, k it reads).

Per chunk with state S [K, V] at its start, G the in-chunk cumulative log-decay and gamma = G at its end:
    v_new = u - w S;  o = scale (q exp(G)) S + scale A_qk v_new;  S <- exp(gamma) S + (k exp(gamma - G))^T v_new.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.gate import load_log_decay
from kernels.kda.tuning import configs, fit_v

# The state pass is one chain of dependent chunk steps per (document, head). Few chains (one long sequence): narrow
# V blocks shorten each step and occupy more SMs. Many chains (packed documents) fill the GPU anyway, and wide V
# blocks then load each chunk's w, q and k fewer times. The key's CHAINS (log2 of their number) tells them apart.
STATE_PASS_SPACE = [({"BV": 32}, 8), ({"BV": 16}, 8), ({"BV": 16}, 4), ({"BV": 32}, 4), ({"BV": 64}, 8)]


def chain_bucket(n_chains: int) -> int:
    """log2 bucket of the number of independent state chains, for the state passes' autotune key."""
    return n_chains.bit_length()


@triton.jit
def chunk_kda_decay_kernel(
    q, k, g, A_log, dt_bias, qg, kd, gam, chunks,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, G_MIN: tl.constexpr,
):
    """q exp(G), k exp(gamma - G) and gamma per chunk, so the state passes do no scans or exps on their chain."""
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


def chunk_kda_decay(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, gate: tuple, chunks: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qg = q exp(G), kd = k exp(gamma - G) [1, T, H, K] (q's dtype) and gamma [NT, H, K] float32."""
    _, T, H, K = q.shape
    A_log, dt_bias, g_min = gate
    qg, kd = torch.empty_like(q), torch.empty_like(k)
    gam = q.new_empty(chunks.shape[0], H, K, dtype=torch.float32)
    BK = min(K, 64)
    chunk_kda_decay_kernel[(chunks.shape[0], H, K // BK)](
        q, k, g, A_log, dt_bias, qg, kd, gam, chunks, H=H, K=K, BT=64, BK=BK,
        USE_GATE=A_log is not None, HAS_BIAS=dt_bias is not None, G_MIN=g_min, num_warps=4,
    )
    return qg, kd, gam


@triton.autotune(configs(STATE_PASS_SPACE), key=["H", "K", "V", "CHAINS"], restore_value=["u"],
                 prune_configs_by={"early_config_prune": fit_v})
@triton.jit
def chunk_kda_fwd_h_kernel(
    qg, kd, gam, w, u, Aqk, o, h, h0, ht, cu_seqlens, chunk_offsets, order, scale, CHAINS,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, SAVE_H: tl.constexpr, PREC: tl.constexpr,
):
    i_v, i_h = tl.program_id(0), tl.program_id(1) % H
    i_n = tl.load(order + tl.program_id(1) // H)
    i_nh = i_n * H + i_h
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    NT = tl.cdiv((eos - bos).to(tl.int32), BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_s = o_k[:, None] * V + o_v[None, :]
    dt = w.dtype.element_ty

    b_S = tl.zeros([K, BV], dtype=tl.float32)
    if USE_H0:
        b_S += tl.load(h0 + i_nh.to(tl.int64) * K * V + p_s).to(tl.float32)
    for i_t in range(NT):
        rows = bos + i_t * BT + o_t
        m_t = rows < eos
        if SAVE_H:
            tl.store(h + ((c0 + i_t) * H + i_h) * K * V + p_s, b_S.to(h.dtype.element_ty))
        p_k = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        p_v = rows[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_w = tl.load(w + p_k, mask=m_t[:, None], other=0.)
        b_vn = tl.load(u + p_v, mask=m_t[:, None], other=0.).to(tl.float32)
        b_vn -= tl.dot(b_w, b_S.to(dt), input_precision=PREC)
        tl.store(u + p_v, b_vn.to(u.dtype.element_ty), mask=m_t[:, None])

        b_qg = tl.load(qg + p_k, mask=m_t[:, None], other=0.)
        b_kd = tl.load(kd + p_k, mask=m_t[:, None], other=0.)
        b_gam = tl.load(gam + ((c0 + i_t) * H + i_h) * K + o_k)
        b_A = tl.load(Aqk + rows[:, None] * (H * BT) + i_h * BT + o_t[None, :], mask=m_t[:, None], other=0.)
        b_o = tl.dot(b_qg, b_S.to(dt), input_precision=PREC)
        b_o += tl.dot(b_A.to(dt), b_vn.to(dt), input_precision=PREC)
        tl.store(o + p_v, (b_o * scale).to(o.dtype.element_ty), mask=m_t[:, None])
        b_S = b_S * tl.exp(b_gam)[:, None] + tl.dot(tl.trans(b_kd), b_vn.to(dt), input_precision=PREC)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + p_s, b_S)


def chunk_kda_fwd_h(decayed: tuple[torch.Tensor, torch.Tensor, torch.Tensor], w: torch.Tensor, u: torch.Tensor,
                    Aqk: torch.Tensor, scale: float, initial_state: torch.Tensor | None, output_final_state: bool,
                    save_h: bool, cu_seqlens: torch.Tensor, chunk_offsets: torch.Tensor, order: torch.Tensor, prec: str
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """o [1, T, H, V]; final state [N, H, K, V] fp32; h [NT, H, K, V] (state at each chunk start), from the decayed
    q, k and chunk decays (qg, kd, gam) that `chunk_kda_fwd_intra` wrote.

    Overwrites u with v_new = u - w S (what the backward pass reads).
    """
    qg, kd, gam = decayed
    H, K = qg.shape[2], qg.shape[3]
    V = u.shape[-1]
    N = cu_seqlens.numel() - 1
    o = torch.empty_like(u)
    h = qg.new_empty(gam.shape[0], H, K, V) if save_h else None
    ht = qg.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    chunk_kda_fwd_h_kernel[lambda meta: (V // meta["BV"], N * H)](
        qg, kd, gam, w, u, Aqk, o, h, initial_state, ht, cu_seqlens, chunk_offsets, order, scale, chain_bucket(N * H),
        H=H, K=K, V=V, BT=64, USE_H0=initial_state is not None, STORE_HT=output_final_state, SAVE_H=save_h, PREC=prec,
    )
    return o, ht, h
