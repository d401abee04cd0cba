"""Block AttnRes in two phases: the finished blocks' part of all of a block's mixtures at once, then one merge per
sublayer with the open block (the Attention Residuals paper's two-phase computation, arXiv 2603.15031).

Every sublayer of block n mixes the same finished blocks ``b_0 … b_{n−1}`` (only its pseudo-query differs) plus the
open block's running sum. Mixed one sublayer at a time (``kernels.attn_res.mix``), each of the block's S sublayers
reads every finished block again forward, twice again backward, and adds into each one's gradient sum (read and
write): about ``4N`` passes over ``[T, d]`` per sublayer for N finished blocks. Here ``block_mix`` reads each
finished block once for all S queries (online softmax per query) and writes each sublayer's part ``o_l`` with its
log-sum-exp; ``merge`` then joins ``o_l`` with the open block (``sigmoid(lse − s_p)`` is the finished blocks' share
of the softmax over all sources) and applies the sublayer's RMSNorm. Backward, ``merge`` hands ``do_l`` and
``dlse_l`` to the block's backward through a ``BlockGrads`` (autograd would otherwise materialise each as a separate
tensor and the block's backward would copy them together), and the block's backward reads each finished block twice
(the second read is an L2 hit at its row tile) and adds into each one's gradient sum once for the whole block.

The cost is memory: each sublayer's ``o_l`` ``[T, d]`` lives until its backward (5 GiB at 8 × 8K for ``small``'s 40
sublayers, 80 at 1M tokens), so the decoder runs two-phase only for blocks outside the recomputed layers.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.attn_res.mix import _snapshot_sums, check_sources, gradient_targets, rms_norm, rms_norm_bwd, use_kernels
from kernels.attn_res.naive import naive_attn_res_block_mix, naive_attn_res_merge
from kernels.grad_sink import GradSink
from kernels.tuning import autotune

__all__ = ["BlockMixture", "attn_res_block_mix", "attn_res_merge"]

# Rows one program walks through one at a time, its queries ([S, d] float32, padded to SP rows) loaded once.
# The backward's pseudo-query partials are [programs, SP, d] float32: its rows per program are kept high. By ptxas
# (sm_90, N = 8, S = 5, d = 1024): forward 173 registers at 8 warps, 128 at 16, no spills; backward 255 at 8
# warps without spills, 128 at 16 with 16 B. Tuned per power-of-two class of the finished-block count (NP), as the
# one-sublayer mixture is: four classes for ``small``'s 1 to 8, each other count compiling only its class's pick.
BLOCK_FWD_SPACE = [({"ROWS": 16}, 8), ({"ROWS": 16}, 16), ({"ROWS": 64}, 8)]
BLOCK_BWD_SPACE = [({"ROWS": 64}, 8), ({"ROWS": 64}, 16), ({"ROWS": 128}, 8)]
BLOCK_TUNING_KEY = ["NP", "SP", "D"]
MERGE_FWD_SPACE = [({"BT": 2}, 4), ({"BT": 1}, 4), ({"BT": 4}, 8), ({"BT": 1}, 2)]
MERGE_BWD_SPACE = [({"BT": 1}, 4), ({"BT": 2}, 8), ({"BT": 1}, 8), ({"BT": 4}, 8)]
# Rows per merge backward program: its pseudo-query and norm-weight partials are one row [d] float32 each.
MERGE_ROWS = 64


@autotune(BLOCK_FWD_SPACE, key=BLOCK_TUNING_KEY)
@triton.jit
def block_mix_fwd_kernel(srcs, rms, q, o, lse, T, N: tl.constexpr, NP: tl.constexpr, S: tl.constexpr,
                         SP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr):
    """o[l, t] = Σ_i softmax_i(s_li) x_i[t] and lse[l, t] for the S queries and the program's ROWS rows."""
    o_s, o_d = tl.arange(0, SP), tl.arange(0, BD)
    m_s, m_d = o_s < S, o_d < D
    m_sd = m_s[:, None] & m_d[None, :]
    o_s64 = o_s.to(tl.int64)
    b_q = tl.load(q + o_s[:, None] * D + o_d[None, :], mask=m_sd, other=0.).to(tl.float32)
    for r in range(ROWS):
        t = tl.program_id(0).to(tl.int64) * ROWS + r
        m_t = t < T
        b_max = tl.full([SP], float("-inf"), tl.float32)
        b_sum = tl.zeros([SP], dtype=tl.float32)
        b_acc = tl.zeros([SP, BD], dtype=tl.float32)
        for i in tl.static_range(N):
            b_x = tl.load(srcs[i] + t * D + o_d, mask=m_d & m_t, other=0.).to(tl.float32)
            s_i = tl.sum(b_q * b_x[None, :], 1) * tl.load(rms[i] + t, mask=m_t, other=0.)
            new_max = tl.maximum(b_max, s_i)
            scale, p = tl.exp(b_max - new_max), tl.exp(s_i - new_max)
            b_acc = b_acc * scale[:, None] + p[:, None] * b_x[None, :]
            b_sum = b_sum * scale + p
            b_max = new_max
        tl.store(o + o_s64[:, None] * T * D + t * D + o_d[None, :], (b_acc / b_sum[:, None]).to(o.dtype.element_ty),
                 mask=m_sd & m_t)
        tl.store(lse + o_s64 * T + t, b_max + tl.log(b_sum), mask=m_s & m_t)


@autotune(BLOCK_BWD_SPACE, key=BLOCK_TUNING_KEY, pre_hook=_snapshot_sums.before, post_hook=_snapshot_sums.after)
@triton.jit(do_not_specialize=["acc"])
def block_mix_bwd_kernel(srcs, rms, q, lse, do, dlse, scratch, dsrcs, drms, dq, T, acc, N: tl.constexpr,
                         NP: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                         ROWS: tl.constexpr):
    """Each finished block's gradient (added into ``dsrcs[i]`` when bit i of ``acc`` is set) and inv_rms gradient for
    the program's rows, and its partial sum of the queries' gradients ``[SP, d]``. With a_li the weights, the logits'
    gradient is ``ds_li = a_li (do_l·x_i − do_l·o_l + dlse_l)`` where ``do_l·o_l = Σ_i a_li do_l·x_i``: a first loop
    over the sources takes the dots (kept in ``scratch`` ``[T, N, 2, SP]``), a second writes the gradients."""
    i_p = tl.program_id(0)
    o_s, o_d = tl.arange(0, SP), tl.arange(0, BD)
    m_s, m_d = o_s < S, o_d < D
    m_sd = m_s[:, None] & m_d[None, :]
    o_s64 = o_s.to(tl.int64)
    b_q = tl.load(q + o_s[:, None] * D + o_d[None, :], mask=m_sd, other=0.).to(tl.float32)
    b_dq = tl.zeros([SP, BD], dtype=tl.float32)
    for r in range(ROWS):
        t = i_p.to(tl.int64) * ROWS + r
        m_t = t < T
        b_do = tl.load(do + o_s64[:, None] * T * D + t * D + o_d[None, :], mask=m_sd & m_t, other=0.).to(tl.float32)
        b_lse = tl.load(lse + o_s64 * T + t, mask=m_s & m_t, other=0.)
        b_c = tl.zeros([SP], dtype=tl.float32)
        for i in tl.static_range(N):
            b_x = tl.load(srcs[i] + t * D + o_d, mask=m_d & m_t, other=0.).to(tl.float32)
            s_i = tl.sum(b_q * b_x[None, :], 1) * tl.load(rms[i] + t, mask=m_t, other=0.)
            dd_i = tl.sum(b_do * b_x[None, :], 1)
            b_c += tl.where(m_s, tl.exp(s_i - b_lse), 0.) * dd_i
            tl.store(scratch + ((t * N + i) * 2) * SP + o_s, s_i, mask=m_t)
            tl.store(scratch + ((t * N + i) * 2 + 1) * SP + o_s, dd_i, mask=m_t)
        tl.debug_barrier()  # the dots just stored are read back below, maybe by other threads of the block
        b_c = tl.load(dlse + o_s64 * T + t, mask=m_s & m_t, other=0.) - b_c
        for i in tl.static_range(N):
            s_i = tl.load(scratch + ((t * N + i) * 2) * SP + o_s, mask=m_t, other=0.)
            b_a = tl.where(m_s, tl.exp(s_i - b_lse), 0.)
            ds_i = b_a * (tl.load(scratch + ((t * N + i) * 2 + 1) * SP + o_s, mask=m_t, other=0.) + b_c)
            b_r = tl.load(rms[i] + t, mask=m_t, other=0.)
            b_x = tl.load(srcs[i] + t * D + o_d, mask=m_d & m_t, other=0.).to(tl.float32)
            b_dx = tl.sum(b_a[:, None] * b_do + (ds_i * b_r)[:, None] * b_q, 0)
            if (acc >> i) & 1:
                b_dx += tl.load(dsrcs[i] + t * D + o_d, mask=m_d & m_t, other=0.).to(tl.float32)
            tl.store(dsrcs[i] + t * D + o_d, b_dx.to(dsrcs[i].dtype.element_ty), mask=m_d & m_t)
            # inv_rms's gradient: Σ_l ds_li x_i·q_l, with x_i·q_l = s_li / r_i
            tl.store(drms[i] + t, tl.sum(ds_i * s_i, 0) / b_r, mask=m_t)
            b_dq += (ds_i * b_r)[:, None] * b_x[None, :]
    tl.store(dq + (i_p * SP + o_s)[:, None] * D + o_d[None, :], b_dq, mask=m_sd)


@autotune(MERGE_FWD_SPACE, key=["D", "HAS_P"])
@triton.jit
def merge_fwd_kernel(o, lse, xp, rp, q, g, y, sp, T, eps, D: tl.constexpr, BD: tl.constexpr, HAS_P: tl.constexpr,
                     BT: tl.constexpr):
    """y = RMSNorm(σ o + (1 − σ) x_p) · g, σ = sigmoid(lse − s_p), for BT rows; sp: their s_p = r_p x_p·q."""
    o_t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_t, m_d = o_t < T, o_d < D
    m = m_t[:, None] & m_d[None, :]
    b_h = tl.load(o + o_t[:, None] * D + o_d[None, :], mask=m, other=0.).to(tl.float32)
    if HAS_P:
        b_xp = tl.load(xp + o_t[:, None] * D + o_d[None, :], mask=m, other=0.).to(tl.float32)
        b_q = tl.load(q + o_d, mask=m_d, other=0.).to(tl.float32)
        s_p = tl.sum(b_xp * b_q[None, :], 1) * tl.load(rp + o_t, mask=m_t, other=0.)
        tl.store(sp + o_t, s_p, mask=m_t)
        b_gap = tl.load(lse + o_t, mask=m_t, other=0.) - s_p
        # 1 − σ as σ(−x): as a difference it lost its digits where σ nears 1 (3.6e-4 off in float32, a test's seed)
        b_h = tl.sigmoid(b_gap)[:, None] * b_h + tl.sigmoid(-b_gap)[:, None] * b_xp
    b_y = rms_norm(b_h, tl.load(g + o_d, mask=m_d, other=0.).to(tl.float32), eps, D)
    tl.store(y + o_t[:, None] * D + o_d[None, :], b_y.to(y.dtype.element_ty), mask=m)


@autotune(MERGE_BWD_SPACE, key=["D", "HAS_P"])
@triton.jit
def merge_bwd_kernel(o, lse, xp, rp, q, g, sp, dy, do, dlse, dxp, drp, dq, dg, T, eps, D: tl.constexpr,
                     BD: tl.constexpr, HAS_P: tl.constexpr, ROWS: tl.constexpr, BT: tl.constexpr):
    """do, dlse (the block's), dxp, drp for the program's ROWS rows, and its partials of dq and dg ``[d]``."""
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_g = tl.load(g + o_d, mask=m_d, other=0.).to(tl.float32)
    b_q = tl.load(q + o_d, mask=m_d, other=0.).to(tl.float32)
    b_dq = tl.zeros([BD], dtype=tl.float32)
    b_dg = tl.zeros([BD], dtype=tl.float32)
    for r in range(ROWS // BT):
        o_t = i_p.to(tl.int64) * ROWS + r * BT + tl.arange(0, BT)
        m_t = o_t < T
        m = m_t[:, None] & m_d[None, :]
        b_o = tl.load(o + o_t[:, None] * D + o_d[None, :], mask=m, other=0.).to(tl.float32)
        b_h = b_o
        if HAS_P:
            b_xp = tl.load(xp + o_t[:, None] * D + o_d[None, :], mask=m, other=0.).to(tl.float32)
            s_p = tl.load(sp + o_t, mask=m_t, other=0.)
            b_gap = tl.load(lse + o_t, mask=m_t, other=0.) - s_p
            b_sig, b_rest = tl.sigmoid(b_gap), tl.sigmoid(-b_gap)   # σ and 1 − σ
            b_h = b_sig[:, None] * b_o + b_rest[:, None] * b_xp
        b_dy = tl.load(dy + o_t[:, None] * D + o_d[None, :], mask=m, other=0.).to(tl.float32)
        b_dh, dg_rows = rms_norm_bwd(b_dy, b_h, b_g, eps, D)
        b_dg += dg_rows
        if HAS_P:
            tl.store(do + o_t[:, None] * D + o_d[None, :], (b_sig[:, None] * b_dh).to(do.dtype.element_ty), mask=m)
            b_k = b_sig * b_rest * tl.sum(b_dh * (b_o - b_xp), 1)   # dlse; the logit s_p's is −b_k
            tl.store(dlse + o_t, b_k, mask=m_t)
            b_r = tl.load(rp + o_t, mask=m_t, other=0.)
            b_dxp = b_rest[:, None] * b_dh - (b_k * b_r)[:, None] * b_q[None, :]
            tl.store(dxp + o_t[:, None] * D + o_d[None, :], b_dxp.to(dxp.dtype.element_ty), mask=m)
            tl.store(drp + o_t, -b_k * s_p / b_r, mask=m_t)
            b_dq -= tl.sum((b_k * b_r)[:, None] * b_xp, 0)
        else:
            tl.store(do + o_t[:, None] * D + o_d[None, :], b_dh.to(do.dtype.element_ty), mask=m)
            tl.store(dlse + o_t, tl.zeros([BT], dtype=tl.float32), mask=m_t)
    tl.store(dq + i_p * D + o_d, b_dq, mask=m_d)
    tl.store(dg + i_p * D + o_d, b_dg, mask=m_d)


@dataclasses.dataclass(eq=False)
class BlockGrads:
    """The gradients of a block's ``count`` parts, ``do`` ``[count, T, d]`` and ``dlse`` ``[count, T]``, written by
    each sublayer's merge backward (slot ``l``) for the block's backward, which runs after all of them (they consume
    its outputs)."""

    count: int
    do: torch.Tensor | None = None
    dlse: torch.Tensor | None = None
    filled: set[int] = dataclasses.field(default_factory=set)

    def slots(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both, allocated by the first caller in the shape and dtype of a part ``like``."""
        if self.do is None:
            self.do = torch.empty(self.count, *like.shape, dtype=like.dtype, device=like.device)
            self.dlse = torch.empty(self.count, like.shape[0], dtype=torch.float32, device=like.device)
        return self.do, self.dlse


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMixture:
    """One block's finished-blocks parts: ``mixed[l]`` ``[T, d]`` and ``lse[l]`` ``[T]`` for its l-th sublayer."""

    mixed: tuple[torch.Tensor, ...]
    lse: tuple[torch.Tensor, ...]
    grads: BlockGrads | None  # None on the reference path (autograd carries the gradients)


class BlockMix(torch.autograd.Function):
    """Saves the queries, the log-sum-exps and the sources (alive anyway); the parts ``o_l`` are the merges' to save."""

    @staticmethod
    def forward(ctx, queries: torch.Tensor, grads: BlockGrads, sinks: tuple[GradSink | None, ...],  # noqa: ANN001
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(sinks)
        sources, rms = tensors[:n], tensors[n:]
        S, (T, D) = queries.shape[0], sources[0].shape
        o = torch.empty(S, T, D, dtype=sources[0].dtype, device=sources[0].device)
        lse = torch.empty(S, T, dtype=torch.float32, device=o.device)
        meta = dict(N=n, NP=triton.next_power_of_2(n), S=S, SP=max(triton.next_power_of_2(S), 2), D=D,
                    BD=triton.next_power_of_2(D))
        block_mix_fwd_kernel[lambda m: (triton.cdiv(T, m["ROWS"]),)](sources, rms, queries, o, lse, T, **meta)
        ctx.save_for_backward(queries, lse, *tensors)
        ctx.meta, ctx.sinks, ctx.grads = meta, sinks, grads
        ctx.set_materialize_grads(False)  # the merges hand their gradients over in ``grads``: no zeros
        return (*o.unbind(0), *lse.unbind(0))

    @staticmethod
    def backward(ctx, *grads_out: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        queries, lse, *tensors = ctx.saved_tensors
        n, S = ctx.meta["N"], ctx.meta["S"]
        sources, rms = tuple(tensors[:n]), tuple(tensors[n:])
        T, D = sources[0].shape
        do, dlse = ctx.grads.slots(sources[0])
        for l in range(S):  # parts no merge took (or that reached autograd some other way)
            extra_o, extra_lse = grads_out[l], grads_out[S + l]
            if l not in ctx.grads.filled:
                do[l].zero_()
                dlse[l].zero_()
            if extra_o is not None:
                do[l] += extra_o
            if extra_lse is not None:
                dlse[l] += extra_lse
        ctx.grads.do = ctx.grads.dlse = None
        dsrcs, accumulate = gradient_targets(sources, ctx.sinks)
        drms = tuple(torch.empty_like(r) for r in rms)
        scratch = torch.empty(T, n, 2, ctx.meta["SP"], dtype=torch.float32, device=lse.device)
        # The queries' partials, one [SP, d] row per program: as many as the config with the fewest rows a program
        # runs; only the rows of the programs the chosen config ran are summed (a tuning run may have left others).
        fewest = min(c.kwargs["ROWS"] for c in block_mix_bwd_kernel.configs)
        dq = torch.empty(triton.cdiv(T, fewest), ctx.meta["SP"], D, dtype=torch.float32, device=lse.device)
        block_mix_bwd_kernel[lambda m: (triton.cdiv(T, m["ROWS"]),)](
            sources, rms, queries, lse, do, dlse, scratch, tuple(dsrcs), drms, dq, T, accumulate, **ctx.meta)
        ran = triton.cdiv(T, block_mix_bwd_kernel.best_config.kwargs["ROWS"])
        dqueries = dq[:ran, :S].sum(0).to(queries.dtype)
        dsources = [None if sink is not None else d for d, sink in zip(dsrcs, ctx.sinks)]
        return (dqueries, None, None, *dsources, *drms)


class Merge(torch.autograd.Function):
    """Saves the part, its lse, the open block and its inv_rms (alive anyway: the part is the one ``[T, d]`` this
    adds to memory) and s_p float32 ``[T]``."""

    @staticmethod
    def forward(ctx, mixed: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor | None,  # noqa: ANN001
                partial_rms: torch.Tensor | None, query: torch.Tensor, weight: torch.Tensor, eps: float,
                grads: BlockGrads, slot: int) -> torch.Tensor:
        T, D = mixed.shape
        has_p = partial is not None
        y = torch.empty_like(mixed)
        s_p = torch.empty(T, dtype=torch.float32, device=y.device) if has_p else lse
        meta = dict(D=D, BD=triton.next_power_of_2(D), HAS_P=has_p)
        xp, rp = (partial, partial_rms) if has_p else (mixed, lse)
        merge_fwd_kernel[lambda m: (triton.cdiv(T, m["BT"]),)](mixed, lse, xp, rp, query, weight, y, s_p, T, eps,
                                                                 **meta)
        ctx.save_for_backward(mixed, lse, xp, rp, query, weight, s_p)
        ctx.meta, ctx.eps, ctx.grads, ctx.slot = meta, eps, grads, slot
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        mixed, lse, xp, rp, query, weight, s_p = ctx.saved_tensors
        T, D = mixed.shape
        has_p = ctx.meta["HAS_P"]
        do, dlse = ctx.grads.slots(mixed)
        programs = triton.cdiv(T, MERGE_ROWS)
        dxp = torch.empty_like(xp) if has_p else do[ctx.slot]
        drp = torch.empty_like(rp) if has_p else dlse[ctx.slot]
        dq = torch.empty(programs, D, dtype=torch.float32, device=dy.device)
        dg = torch.empty_like(dq)
        merge_bwd_kernel[(programs,)](mixed, lse, xp, rp, query, weight, s_p, dy.contiguous(), do[ctx.slot],
                                      dlse[ctx.slot], dxp, drp, dq, dg, T, ctx.eps, ROWS=MERGE_ROWS, **ctx.meta)
        ctx.grads.filled.add(ctx.slot)
        dquery = dq.sum(0).to(query.dtype) if has_p else None
        return (None, None, dxp if has_p else None, drp if has_p else None, dquery, dg.sum(0).to(weight.dtype),
                None, None, None)


def attn_res_block_mix(sources: Sequence[torch.Tensor], inv_rms: Sequence[torch.Tensor], queries: torch.Tensor,
                       sinks: Sequence[GradSink | None] | None = None) -> BlockMixture:
    """The finished blocks' parts of one block's mixtures (``naive_attn_res_block_mix``) for ``queries`` ``[S, d]``,
    on the Triton kernels on CUDA (and under ``TRITON_INTERPRET=1``), on the reference elsewhere; feed each part to
    :func:`attn_res_merge`. Arguments as :func:`kernels.attn_res.attn_res_mix`'s."""
    sinks = check_sources(sources, inv_rms, sinks)
    S, D = queries.shape
    if D != sources[0].shape[1] or not 1 <= S <= 16:
        raise ValueError(f"queries must be [S, {sources[0].shape[1]}] with 1 <= S <= 16, got {tuple(queries.shape)}")
    if not use_kernels(sources[0]):
        o, lse = naive_attn_res_block_mix(sources, inv_rms, queries)
        return BlockMixture(tuple(o.unbind(0)), tuple(lse.unbind(0)), None)
    tensors = [s.contiguous() for s in sources] + [r.contiguous() for r in inv_rms]
    grads = BlockGrads(S)
    out = BlockMix.apply(queries.contiguous(), grads, sinks, *tensors)
    return BlockMixture(tuple(out[:S]), tuple(out[S:]), grads)


def attn_res_merge(block: BlockMixture, slot: int, partial: torch.Tensor | None, partial_rms: torch.Tensor | None,
                   query: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Sublayer ``slot`` of ``block``'s normed input: its part merged with the open block ``partial`` (and its
    inv_rms; None before the block's first add), RMSNorm'ed with ``weight`` (``naive_attn_res_merge``)."""
    mixed, lse = block.mixed[slot], block.lse[slot]
    if (partial is None) != (partial_rms is None) or (partial is not None and partial.shape != mixed.shape):
        raise ValueError(f"partial: need [T, d] = {list(mixed.shape)} with its inv_rms, or neither")
    if block.grads is None:
        return naive_attn_res_merge(mixed, lse, partial, partial_rms, query, weight, eps)
    return Merge.apply(mixed, lse, None if partial is None else partial.contiguous(), partial_rms, query, weight,
                       float(eps), block.grads, slot)
