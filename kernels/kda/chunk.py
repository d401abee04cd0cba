"""Chunked KDA: the autograd Function over the Triton kernels, and the one public entry point `chunk_kda`."""
from __future__ import annotations

import os

import torch

from kernels.kda.chunk_bwd import chunk_kda_bwd
from kernels.kda.chunk_fwd import chunk_kda_fwd_h
from kernels.kda.chunk_intra import chunk_kda_fwd_intra
from kernels.kda.gate import gate_param_grads, kda_gate
from kernels.kda.host_cache import HOST_CU_SEQLENS, TensorMemo
from kernels.kda.l2norm import l2norm, l2norm_reference
from kernels.kda.naive import CHUNK, naive_chunk_kda

# Read once at import: the Triton kernels are built for the interpreter only if it was on when they were defined.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# The kernels' chunk sizes (tokens): sub-chunks of 16 are what the gate's bound allows (exponents within 80), and a
# chunk of 32 has two where one of 64 has four. By ptxas (sm_90, 8 heads of 128), 32 fits twice the forward intra
# kernel's programs on a multiprocessor at BK = BV = 32 (128 registers, 4 programs) and halves its Gram tiles; its
# state passes walk twice the chunks.
CHUNK_SIZES = (32, CHUNK)


def _plan_chunks(cu_seqlens: torch.Tensor, device: torch.device, chunk: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cu = HOST_CU_SEQLENS.get(cu_seqlens).long()
    n_chunks = (cu[1:] - cu[:-1] + chunk - 1) // chunk
    offsets = torch.cat([cu.new_zeros(1), n_chunks.cumsum(0)])
    seq = torch.repeat_interleave(torch.arange(n_chunks.numel()), n_chunks)
    local = torch.arange(int(offsets[-1])) - offsets[seq]
    chunks = torch.stack([cu[seq] + local * chunk, cu[seq + 1]], 1)
    order = torch.argsort(n_chunks, descending=True, stable=True)
    return to_device(offsets, device), to_device(chunks, device), to_device(order, device)


# The model passes one cu_seqlens tensor to every KDA layer of a micro-batch and to their recomputes: the tables are
# built once. Building them took about 5 ms of host time per call at the 8k stage's 131K tokens (66 documents), 30
# calls per micro-batch, in the thread that launches the kernels.
CHUNK_PLANS = TensorMemo(_plan_chunks)


def prepare_chunks(cu_seqlens: torch.Tensor, device: torch.device, chunk: int = CHUNK
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunk_offsets [N+1] (first chunk of each document), chunks [NT, 2] (start token, document end) and order [N]
    (documents longest first) for chunks of ``chunk`` tokens, int32, on ``device``; memoised for the last few
    cu_seqlens tensors.

    The state passes run one chain per (document, head) in launch order `order`: when the chains outnumber the GPU's
    slots, the longest starts first rather than whenever its index comes up (longest-processing-time first)."""
    return CHUNK_PLANS.get(cu_seqlens, device, chunk)


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """int32 copy on device; from the host through pinned memory without blocking, so the launch queue never waits."""
    x = x.to(torch.int32)
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def _precisions(dtype: torch.dtype) -> tuple[str, str]:
    """tl.dot precision for float32 operands (Gram and products, UT inverse): exact in float32 runs, tf32 otherwise
    (the inverse is saved in bf16, whose rounding is coarser than tf32's)."""
    return ("ieee", "ieee") if dtype == torch.float32 else ("tf32", "tf32")


class ChunkKDAFunction(torch.autograd.Function):
    """Forward: intra-chunk kernel, then the state pass fused with the output. Backward: reverse state pass, then
    one parallel kernel for every gradient. Saved: A_qk, the UT inverse, w, v_new and the chunk-start states."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, g_min: float, scale: float,
                initial_state: torch.Tensor | None, output_final_state: bool, cu_seqlens: torch.Tensor, chunk: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, H, K = q.shape
        V = v.shape[-1]
        q, k, v, g = (x.reshape(1, B * T, H, -1).contiguous() for x in (q, k, v, g))
        beta = beta.reshape(1, B * T, H).contiguous()
        chunk_offsets, chunks, order = prepare_chunks(cu_seqlens, q.device, chunk)
        cu_seqlens = to_device(cu_seqlens, q.device)
        h0 = initial_state.float().contiguous() if initial_state is not None else None
        gate = (A_log, dt_bias, g_min)
        prec = _precisions(q.dtype)
        Aqk, Ainv, w, u, decayed = chunk_kda_fwd_intra(q, k, v, g, beta, gate, chunks, prec, chunk)
        o, ht, h = chunk_kda_fwd_h(decayed, w, u, Aqk, scale, h0, output_final_state, any(ctx.needs_input_grad),
                                   cu_seqlens, chunk_offsets, order, prec[0])
        del decayed
        # Everything through save_for_backward, so that activation checkpointing drops and recomputes it too.
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets, order, chunks,
                              Aqk, Ainv, w, u, h)
        ctx.meta = (B, T, g_min, scale, h0 is not None, initial_state.dtype if h0 is not None else None)
        return o.view(B, T, H, V), ht

    @staticmethod
    def backward(ctx, do: torch.Tensor, dht: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets, order, chunks, *inter = ctx.saved_tensors
        saved = dict(zip(("Aqk", "Ainv", "w", "vn", "h"), inter))
        del inter
        B, T, g_min, scale, has_h0, h0_dtype = ctx.meta
        H, K, V = q.shape[2], q.shape[3], v.shape[3]
        do = do.reshape(1, B * T, H, V).contiguous()
        dht = dht.float().contiguous() if dht is not None else None
        dq, dk, dv, dg, dbeta, dh0 = chunk_kda_bwd(
            q, k, v, g, beta, (A_log, dt_bias, g_min), saved, do, dht, scale, has_h0,
            cu_seqlens, chunk_offsets, order, chunks, _precisions(q.dtype)[0])
        dA_log = d_dt_bias = None
        if A_log is not None:
            dA_log, d_dt_bias = gate_param_grads(dg, g, dt_bias)
            dA_log = dA_log.to(A_log.dtype)
            d_dt_bias = d_dt_bias.to(dt_bias.dtype) if dt_bias is not None else None
        shape = (B, T, H)
        return (dq.view(*shape, K), dk.view(*shape, K), dv.view(*shape, V), dg.view(*shape, K),
                dbeta.view(shape).to(beta.dtype), dA_log, d_dt_bias, None, None,
                dh0.to(h0_dtype) if has_h0 else None, None, None, None)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           scale: float | None, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
           A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, g_min: float, chunk_size: int) -> int:
    """Validate every argument once; returns the number of documents N."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got shape {tuple(v.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have q's shape {tuple(q.shape)}, got {tuple(g.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got shape {tuple(beta.shape)}")
    V = v.shape[-1]
    for name, d in (("K", K), ("V", V)):
        if d not in (32, 64, 128):
            raise ValueError(f"head dim {name} must be one of 32, 64, 128, got {d}")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}")
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    N = B
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [N+1], got {cu_seqlens.dtype} "
                             f"shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"packed documents (cu_seqlens) need B == 1, got B={B}")
        cu = HOST_CU_SEQLENS.get(cu_seqlens)
        if cu[0] != 0 or cu[-1] != T or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu.tolist()}")
        N = cu.numel() - 1
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V] = [{N}, {H}, {K}, {V}], "
                         f"got shape {tuple(initial_state.shape)}")
    if A_log is None and dt_bias is not None:
        raise ValueError("dt_bias needs A_log (the in-kernel gate); got dt_bias without A_log")
    if A_log is not None:
        if A_log.shape != (H,):
            raise ValueError(f"A_log must be [H] = [{H}], got shape {tuple(A_log.shape)}")
        if dt_bias is not None and dt_bias.shape != (H * K,):
            raise ValueError(f"dt_bias must be [H*K] = [{H * K}], got shape {tuple(dt_bias.shape)}")
        if not -5.0 <= g_min < 0.0:
            raise ValueError(f"g_min must lie in [-5, 0) for the sub-chunk kernels, got {g_min}")
    return N


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    g_min: float = -5.0,
    use_qk_l2norm: bool = False,
    chunk_size: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention over chunks of ``chunk_size`` tokens (32 or 64; sub-chunks of 16), forward and backward.

    q, k [B, T, H, K]; v [B, T, H, V] (same float dtype; bf16 runs with fp32 accumulation; K, V in 32, 64, 128);
    beta [B, T, H] in (0, 1).
    g [B, T, H, K]: the log-decay (float32 preferred), which must lie in [-5, 0]; or, when A_log [H] is given, the
    raw gate input z, and the kernels compute g = g_min * sigmoid(exp(A_log) * (z + dt_bias)) (dt_bias [H*K]
    optional), so g never exists in memory and its bound holds by construction.
    cu_seqlens [N+1] (int32/int64, B == 1): packed documents, state reset at each boundary; on the CPU it costs no
    host sync, on the GPU one per new tensor (its host copy is cached, `kernels.kda.host_cache`).
    initial_state [N, H, K, V]; scale defaults to 1/sqrt(K).
    use_qk_l2norm normalises q and k as x / sqrt(|x|^2 + 1e-6) (float32 arithmetic; one Triton kernel each way).
    Returns o [B, T, H, V] (v's dtype) and the final state [N, H, K, V] float32 if asked, else None.
    Triton on CUDA (and on CPU under TRITON_INTERPRET=1), `naive_chunk_kda` elsewhere (the same numbers up to
    rounding at either chunk size).
    """
    _check(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, g_min, chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not (q.is_cuda or INTERPRET):
        if use_qk_l2norm:
            q, k = l2norm_reference(q), l2norm_reference(k)
        decay = kda_gate(g, A_log, dt_bias, g_min) if A_log is not None else g
        o, final = naive_chunk_kda(q, k, v, decay, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        return o.to(v.dtype), final
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    B, T = q.shape[:2]
    if cu_seqlens is None:
        cu_seqlens = torch.arange(B + 1, dtype=torch.int32) * T
    return ChunkKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, float(g_min), float(scale), initial_state,
                                  output_final_state, cu_seqlens, chunk_size)
