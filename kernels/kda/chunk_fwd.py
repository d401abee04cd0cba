"""Inter-chunk forward: the state recurrence over chunks, fused with the output.

Per chunk with state S [K, V] at its start, G the in-chunk cumulative log-decay and gamma = G at its end:
    v_new = u - w S;  o = scale (q exp(G)) S + scale A_qk v_new;  S <- exp(gamma) S + (k exp(gamma - G))^T v_new.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.tuning import autotune, fit_v

# The state pass is one chain of dependent chunk steps per (document, head). Few chains (one long sequence): narrow
# V blocks shorten each step and occupy more SMs. Many chains (packed documents) fill the GPU anyway, and wide V
# blocks then load each chunk's w, q and k fewer times. The key's CHAINS (log2 of their number) tells them apart.
# STAGES: how deep the loop over a chain's chunks prefetches (``tl.range``). Three deep, the loops hold 180-229 KB
# of shared memory at chunks of 64 (ptxas, sm_90, K = V = 128): one program a multiprocessor, so at 8 x 8K a
# micro-batch some 1,000 chains (documents x heads x V blocks) run 132 at a time. One deep holds 47-70 KB (two or
# three programs), two deep 125-139 KB. A chain is a row of dependent steps: more of them at once may beat one
# prefetching (the tuner decides). At chunks of 32 three deep is already two to three programs.
STATE_PASS_SPACE = [({"BV": 32, "STAGES": 3}, 8), ({"BV": 16, "STAGES": 3}, 8), ({"BV": 16, "STAGES": 3}, 4),
                    ({"BV": 32, "STAGES": 3}, 4), ({"BV": 64, "STAGES": 3}, 8), ({"BV": 16, "STAGES": 1}, 4),
                    ({"BV": 32, "STAGES": 1}, 4), ({"BV": 32, "STAGES": 1}, 8), ({"BV": 16, "STAGES": 2}, 4)]


def chain_bucket(n_chains: int) -> int:
    """log2 bucket of the number of independent state chains, for the state passes' autotune key."""
    return n_chains.bit_length()


@autotune(STATE_PASS_SPACE, key=["H", "K", "V", "CHAINS", "BT"], restore_value=["u"],
          prune_configs_by={"early_config_prune": fit_v})
@triton.jit
def chunk_kda_fwd_h_kernel(
    qg, kd, gam, w, u, Aqk, o, h, h0, ht, cu_seqlens, chunk_offsets, order, scale, CHAINS,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, STAGES: tl.constexpr,
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
    for i_t in tl.range(0, NT, num_stages=STAGES):
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
        H=H, K=K, V=V, BT=Aqk.shape[-1], USE_H0=initial_state is not None, STORE_HT=output_final_state,
        SAVE_H=save_h, PREC=prec,
    )
    return o, ht, h
