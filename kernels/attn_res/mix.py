"""The AttnRes mixture as one Triton kernel each way, the sublayer's RMSNorm fused in.

Each sublayer of block AttnRes mixes up to ten sources ``[T, d]`` (the finished blocks and the open one). Compiled
from PyTorch, the mixture read every source twice forward (Inductor split the reduction, so its online softmax was
off: one pass for the logits, one for the weighted sum), and autograd's backward ran several kernels per source.
Here the forward reads each source once (online softmax over the sources of a row, the norm on the row in
registers) and writes the sublayer's input and the logits ``s_i = r_i x_i·w`` float32 ``[T, n]``. The backward
rebuilds the weights from the logits (a softmax over n per row) and each ``x_i·w`` as ``s_i / r_i`` for the inv_rms
gradients: N fewer cross-warp reductions per row tile than recomputing the dots (2026-12-05; the weights were saved
before, and the backward took 2N+3 reductions). It reads each source once, keeping its row tile in registers
(until 2026-12-07 it read them twice: to rebuild the mixture for the norm's gradient, then for the weights'
gradients), and writes every source's gradient once: the pseudo-query's gradient ``Σ_i ds_i r_i x_i`` is split as
``P − c·Q`` over per-row sums that exist before ``ds`` does, so no second pass over the sources is needed. Taking
the norm's gradient from its saved output instead (``x̂ = y / g`` and a saved 1/rms, as Apex's
memory-efficient norms do: one read of y for N of the sources) was slower on the H100 (2026-12-06, 65,536 × 1,024,
5 sources: forward + backward 1.865 against 1.418 ms with the norm; the 8k stage 11.73–12.02 against 10.72–10.87 s a
step). ptxas gave it 241 registers against 167, its 128-register config spilled 304 B
and was dropped, and without the norm, where only the arguments differed, it was as slow (1.435 against 1.100 ms):
the two-blocks-per-SM config is likely what the tuning picks.

A finished block is a source of every later sublayer. Left to autograd, each of those mixtures' backward writes a
fresh ``[T, d]`` gradient for it and autograd adds it into the block's running sum (read two, write one). A source
passed through ``sinked(x, sink)`` (``kernels.grad_sink``) instead has its gradient added in place by the backward
kernel into ``sink.grad`` (read one, write one, no extra launch), and the ``sinked`` node hands the sum to autograd
once, after every mixture that read the block has run its backward (autograd's order: they all depend on it).

Sources are passed as a tuple of tensors (Triton unrolls the loop over them): stacking them would copy all of them.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.attn_res.naive import naive_attn_res_mix
from kernels.grad_sink import GradSink
from kernels.tuning import autotune

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_SOURCES, MAX_WIDTH = 16, 8192
# Rows per backward program: its pseudo-query and norm-weight partials are one row [d] float32 per program each.
BWD_ROWS = 64

# Tiles that ptxas (sm_90, d = 1024, 9 sources) compiles without spills (`python -m kernels.ptxas_report`): the
# unrolled loop over sources keeps several [BT, d] loads in flight. Forward BT 8 spilled with 8 and 16 warps. The
# backward ran at 0.94 TB/s at BT 2 with 8 warps on the H200 (255 registers: one block of 8 warps per SM), so it is
# tuned too; its tuning runs restore the sinked gradients it adds into (``_snapshot_sums``). Since it reads each
# source's weight and dot from memory rather than out of a [BT, NP] tile (2026-12-05), ptxas gives it 171 registers
# at BT 1 with 8 warps and no spills, still one block per SM; capped at 128 (two blocks, 16 warps to hide the
# latency of its reductions) it spills 88 B per thread. At 16 warps it spilled 168 B, at BT 4 184 B.
# Fewer warps won at every forward key the H200's tuning timed (2026-12-06, the autotuner's own timings at the 8k
# stage: 4 warps at BT 1 or 2, 0.33-0.36 ms at 8 sources, against 0.36-0.53 at 8 warps), so 2 warps joined (72
# and 128 registers, no spills). The backward at 2 warps spilled 420 B: not added. Of the one-tile programs (ROWS =
# BT, one stage) only BT 1 at 2 warps and BT 2 at 2 or 4 ever won a key (the committed picks of 2026-12-07) and
# stay. A program may also run ROWS rows BT at a time, STAGES deep (``tl.range``: the next rows' sources in flight
# through shared memory meanwhile). By ptxas (Triton 3.6, sm_90, 5 / 9 sources with the norm): 80-146 / 128-255
# registers pipelined, no spills, 14-45 KB of shared memory; BT 2 over 32 rows at 2 warps spilled 80 B at 9. The
# H100's tuning kept the one-tile configs for every key (2026-12-07).
FWD_SPACE = [({"BT": 1, "ROWS": 16, "STAGES": 2}, 4), ({"BT": 1, "ROWS": 1, "STAGES": 1}, 2),
             ({"BT": 2, "ROWS": 2, "STAGES": 1}, 2), ({"BT": 2, "ROWS": 2, "STAGES": 1}, 4),
             ({"BT": 1, "ROWS": 16, "STAGES": 2}, 2), ({"BT": 1, "ROWS": 32, "STAGES": 3}, 2),
             ({"BT": 2, "ROWS": 32, "STAGES": 2}, 4)]
# Since the backward loads a row's N sources, logits, inv_rms and the sums it adds into before its first store
# (2026-12-07), ptxas gives it 128 registers at BT 1 with 8 warps for 5 sources, 232 for 9; 16 warps at 128 (84 B
# spilled at 9 sources) joined the space. The tuning picked BT 1 at 4 warps for every key on the H200 and all but
# one on the H100 (BT 1 at 8 warps there); BT 2, the 128-register cap and 16 warps never won and left the space.
# STAGES > 1 pipelines the loop over rows (``tl.range``): the next rows' loads go out through shared memory while
# this row's reductions run. One row at a time, each row waited for its loads and then for its reductions with
# nothing else in flight (about 0.9 ms a call on the H200, half the copy bandwidth by a byte count). By ptxas
# (Triton 3.6, sm_90, 5 / 9 sources with the norm), 2 stages: 255 / 255 registers at 4 warps (88 B spilled at 9),
# 169 / 226 at 8 warps, 23 / 39 KB of shared memory; 3 stages: 8 B spilled at 8 warps and 9 sources. The H100's
# tuning picked 2 or 3 stages at 4 warps for all six keys, and the step took 0.98x (BENCHMARKS.md, 2026-12-07).
BWD_SPACE = [({"BT": 1, "STAGES": 2}, 4), ({"BT": 1, "STAGES": 1}, 4), ({"BT": 1, "STAGES": 1}, 8),
             ({"BT": 1, "STAGES": 2}, 8), ({"BT": 1, "STAGES": 3}, 8), ({"BT": 1, "STAGES": 3}, 4)]
# Tuned per power-of-two class of the source count (NP), not per count: ``small``'s 41 mixtures take 1 to 9 sources,
# and each count tuned afresh compiled and timed every config of both kernels for it: 10 keys, 90 compiles (the 8k
# stage's first step took 279 s on 2026-12-04, 84 s more than with the compiled PyTorch mixture). Six classes; the
# counts of one class share the config found for the first of them, and each count still compiles its own
# (unrolled) kernel once.
TUNING_KEY = ["NP", "D", "NORM"]


class _SumsSnapshot:
    """The autotuner's hooks for the backward: the gradients it adds into (bit i of ``acc`` set) copied before each
    tuning run and put back after it, so tuning leaves every sum as one run would."""

    def __init__(self) -> None:
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def before(self, kwargs: dict, reset_only: bool = False) -> None:
        if not reset_only:
            self.saved = [(d, d.clone()) for i, d in enumerate(kwargs["dsrcs"]) if (kwargs["acc"] >> i) & 1]

    def after(self, kwargs: dict, exception: BaseException | None) -> None:  # noqa: ARG002 - the hook's protocol
        for d, copy in self.saved:
            d.copy_(copy)
        self.saved = []


_snapshot_sums = _SumsSnapshot()


@triton.jit
def rms_norm(b_h, b_g, eps, D: tl.constexpr):
    """``RMSNorm(h) · g`` of rows ``b_h`` [BT, BD] (float32, zero past column D)."""
    return b_h * tl.rsqrt(tl.sum(b_h * b_h, 1) / D + eps)[:, None] * b_g[None, :]


@autotune(FWD_SPACE, key=TUNING_KEY)
@triton.jit
def attn_res_fwd_kernel(srcs, rms, w, g, y, logits, T, eps, N: tl.constexpr, NP: tl.constexpr, D: tl.constexpr,
                        BD: tl.constexpr, NORM: tl.constexpr, BT: tl.constexpr, ROWS: tl.constexpr,
                        STAGES: tl.constexpr):
    """y = mixture (RMSNorm'ed with g if NORM) of the program's ROWS rows, BT at a time, STAGES deep; logits: their
    ``r_i x_i·w`` over the N sources."""
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_w = tl.load(w + o_d, mask=m_d, other=0.).to(tl.float32)
    b_g = tl.load(g + o_d, mask=m_d, other=0.).to(tl.float32)  # g is w when not NORM: loaded, never used
    for r in tl.range(0, ROWS // BT, num_stages=STAGES):
        o_t = tl.program_id(0).to(tl.int64) * ROWS + r * BT + tl.arange(0, BT)
        m_t = o_t < T
        m = m_t[:, None] & m_d[None, :]
        b_max = tl.full([BT], float("-inf"), tl.float32)
        b_sum = tl.zeros([BT], dtype=tl.float32)
        b_acc = tl.zeros([BT, BD], dtype=tl.float32)
        # Every source's rows loaded before the first reduction: a load after a reduction's barrier waits for it, one
        # memory latency per source (see the backward); the logits are stored after the loop.
        xs, rs, ss = (), (), ()
        for i in tl.static_range(N):
            xs = xs + (tl.load(srcs[i] + o_t[:, None] * D + o_d[None, :], mask=m, other=0.),)
            rs = rs + (tl.load(rms[i] + o_t, mask=m_t, other=0.),)
        for i in tl.static_range(N):
            b_x = xs[i].to(tl.float32)
            s_i = tl.sum(b_x * b_w[None, :], 1) * rs[i]
            ss = ss + (s_i,)
            new_max = tl.maximum(b_max, s_i)
            scale, p = tl.exp(b_max - new_max), tl.exp(s_i - new_max)
            b_acc = b_acc * scale[:, None] + p[:, None] * b_x
            b_sum = b_sum * scale + p
            b_max = new_max
        for i in tl.static_range(N):
            tl.store(logits + o_t * N + i, ss[i], mask=m_t)
        b_mix = b_acc / b_sum[:, None]
        if NORM:
            b_mix = rms_norm(b_mix, b_g, eps, D)
        tl.store(y + o_t[:, None] * D + o_d[None, :], b_mix.to(y.dtype.element_ty), mask=m)


@triton.jit
def rms_norm_bwd(b_dy, b_h, b_g, eps, D: tl.constexpr):
    """The gradient of rows ``b_h`` [BT, BD] through ``RMSNorm(h) · g`` from ``b_dy``, and of ``g`` summed over them."""
    b_rinv = tl.rsqrt(tl.sum(b_h * b_h, 1) / D + eps)
    b_gdy = b_dy * b_g[None, :]
    b_c = b_rinv * b_rinv * b_rinv / D * tl.sum(b_gdy * b_h, 1)
    return b_rinv[:, None] * b_gdy - b_h * b_c[:, None], tl.sum(b_dy * b_h * b_rinv[:, None], 0)


@autotune(BWD_SPACE, key=TUNING_KEY, pre_hook=_snapshot_sums.before,
          post_hook=_snapshot_sums.after)
@triton.jit(do_not_specialize=["acc"])
def attn_res_bwd_kernel(srcs, rms, w, g, logits, dy, dsrcs, drms, dw, dg, T, eps, acc, N: tl.constexpr,
                        NP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr,
                        ROWS: tl.constexpr, BT: tl.constexpr, STAGES: tl.constexpr):
    """Every source's gradient and inv_rms gradient for the program's ROWS rows, and its partial sums of the
    pseudo-query's gradient (dw) and of the norm weight's (dg). Source i's gradient is added into ``dsrcs[i]`` when
    bit i of ``acc`` is set, written over it otherwise. ``acc`` is a runtime bit mask, not a constant: as a constant
    a source count compiled this unrolled kernel once per mask, which in block AttnRes is twice (with and without
    the open block among the sources: 17 compiles for ``small``'s mixtures instead of 9).

    Each source's row tile is read once and kept (bf16, a tuple of N tiles: 2 registers a thread each at BT 1 with
    8 warps) for the mixture the norm's gradient needs, the dots ``dm·x_i`` and the pseudo-query's sums; so are the
    dots, for the logits' gradients, and the sums added into, loaded with the rest before the first store. Before
    2026-12-07 the sources were read twice (once for the mixture, once for the rest), the dots went through a
    ``[T, N]`` scratch with a barrier, and each sum was loaded after the previous source's gradient was stored."""
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_w = tl.load(w + o_d, mask=m_d, other=0.).to(tl.float32)
    b_g = tl.load(g + o_d, mask=m_d, other=0.).to(tl.float32)
    b_dw = tl.zeros([BD], dtype=tl.float32)
    b_dg = tl.zeros([BD], dtype=tl.float32)
    for r in tl.range(0, ROWS // BT, num_stages=STAGES):
        o_t = i_p.to(tl.int64) * ROWS + r * BT + tl.arange(0, BT)
        m_t = o_t < T
        m = m_t[:, None] & m_d[None, :]
        # Every load of the row tile first, as tuples: a load after a store to another pointer cannot be moved above
        # it (they might alias), so loads between stores wait for each other, one memory latency per source.
        rows = o_t[:, None] * D + o_d[None, :]
        b_dm = tl.load(dy + rows, mask=m, other=0.).to(tl.float32)
        xs, ss, rs, sums = (), (), (), ()
        for i in tl.static_range(N):
            xs = xs + (tl.load(srcs[i] + rows, mask=m, other=0.),)
            ss = ss + (tl.load(logits + o_t * N + i, mask=m_t, other=0.),)
            rs = rs + (tl.load(rms[i] + o_t, mask=m_t, other=0.),)
            sums = sums + (tl.load(dsrcs[i] + rows, mask=m & ((acc >> i) & 1 == 1), other=0.),)
        # The softmax again from the logits (rows past T get uniform weights: finite).
        b_max = tl.full([BT], float("-inf"), tl.float32)
        for i in tl.static_range(N):
            b_max = tl.maximum(b_max, ss[i])
        b_z = tl.zeros([BT], dtype=tl.float32)
        for i in tl.static_range(N):
            b_z += tl.exp(ss[i] - b_max)
        weights = ()
        for i in tl.static_range(N):
            weights = weights + (tl.exp(ss[i] - b_max) / b_z,)
        if NORM:  # the mixture again, for the norm's gradient
            b_mix = tl.zeros([BT, BD], dtype=tl.float32)
            for i in tl.static_range(N):
                b_mix += weights[i][:, None] * xs[i].to(tl.float32)
            b_dm, dg_rows = rms_norm_bwd(b_dm, b_mix, b_g, eps, D)
            b_dg += dg_rows
        b_c = tl.zeros([BT], dtype=tl.float32)       # Σ_i a_i da_i
        b_pw = tl.zeros([BT, BD], dtype=tl.float32)  # Σ_i a_i r_i da_i x_i
        b_qw = tl.zeros([BT, BD], dtype=tl.float32)  # Σ_i a_i r_i x_i
        das = ()
        for i in tl.static_range(N):
            b_x = xs[i].to(tl.float32)
            da_i = tl.sum(b_dm * b_x, 1)   # dm · x_i
            das = das + (da_i,)
            b_c += weights[i] * da_i
            b_ar = weights[i] * rs[i]
            b_pw += (b_ar * da_i)[:, None] * b_x
            b_qw += b_ar[:, None] * b_x
        b_dw += tl.sum(b_pw - b_c[:, None] * b_qw, 0)
        for i in tl.static_range(N):
            ds_i = weights[i] * (das[i] - b_c)   # the logit's gradient
            b_dx = weights[i][:, None] * b_dm + (ds_i * rs[i])[:, None] * b_w[None, :] + sums[i].to(tl.float32)
            tl.store(dsrcs[i] + rows, b_dx.to(dsrcs[i].dtype.element_ty), mask=m)
            # inv_rms's gradient: ds_i · x_i·w, with x_i·w = s_i / r_i from the saved logit
            tl.store(drms[i] + o_t, ds_i * ss[i] / rs[i], mask=m_t)
    tl.store(dw + i_p * D + o_d, b_dw, mask=m_d)
    if NORM:
        tl.store(dg + i_p * D + o_d, b_dg, mask=m_d)


def gradient_targets(sources: Sequence[torch.Tensor], sinks: Sequence[GradSink | None]
                     ) -> tuple[list[torch.Tensor], int]:
    """Where a backward kernel writes each source's gradient: a fresh tensor (no sink), the sink's sum (bit i of the
    returned mask set: added into), or a sum it starts (the first of the sink's consumers to run backward)."""
    dsrcs, accumulate = [], 0
    for i, (source, sink) in enumerate(zip(sources, sinks)):
        if sink is not None and sink.grad is not None:
            accumulate |= 1 << i
        elif sink is not None:
            sink.grad = torch.empty_like(source)
        dsrcs.append(torch.empty_like(source) if sink is None else sink.grad)
    return dsrcs, accumulate


class AttnResMix(torch.autograd.Function):
    """Saves the sources and inv_rms (alive anyway) and the logits float32 ``[T, n]``; nothing of size ``[T, d]``."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, weight: torch.Tensor | None, eps: float,  # noqa: ANN001
                sinks: tuple[GradSink | None, ...], *tensors: torch.Tensor) -> torch.Tensor:
        n = len(sinks)
        sources, rms = tensors[:n], tensors[n:]
        T, D = sources[0].shape
        y = torch.empty_like(sources[0])
        logits = torch.empty(T, n, dtype=torch.float32, device=y.device)
        norm = weight is not None
        meta = dict(N=n, NP=triton.next_power_of_2(n), D=D, BD=triton.next_power_of_2(D), NORM=norm)
        attn_res_fwd_kernel[lambda m: (triton.cdiv(T, m["ROWS"]),)](
            sources, rms, query, weight if norm else query, y, logits, T, eps, **meta)
        ctx.save_for_backward(query, weight, logits, *tensors)
        ctx.meta, ctx.eps, ctx.sinks = meta, eps, sinks
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        query, weight, logits, *tensors = ctx.saved_tensors
        n = ctx.meta["N"]
        sources, rms = tuple(tensors[:n]), tuple(tensors[n:])
        T, D = sources[0].shape
        programs = triton.cdiv(T, BWD_ROWS)
        dsrcs, accumulate = gradient_targets(sources, ctx.sinks)
        drms = tuple(torch.empty_like(r) for r in rms)
        dw = torch.empty(programs, D, dtype=torch.float32, device=dy.device)
        dg = torch.empty_like(dw) if weight is not None else dw
        attn_res_bwd_kernel[(programs,)](
            sources, rms, query, weight if weight is not None else query, logits, dy.contiguous(), tuple(dsrcs), drms,
            dw, dg, T, ctx.eps, accumulate, ROWS=BWD_ROWS, **ctx.meta)
        dweight = dg.sum(0).to(weight.dtype) if weight is not None else None
        dsources = [None if sink is not None else d for d, sink in zip(dsrcs, ctx.sinks)]
        return (dw.sum(0).to(query.dtype), dweight, None, None, *dsources, *drms)


def attn_res_mix(sources: Sequence[torch.Tensor], inv_rms: Sequence[torch.Tensor], query: torch.Tensor,
                 weight: torch.Tensor | None = None, eps: float | None = None,
                 sinks: Sequence[GradSink | None] | None = None) -> torch.Tensor:
    """``naive_attn_res_mix``'s result (the mixture of sources ``[T, d]``, RMSNorm'ed with ``weight`` if given) from
    the Triton kernels on CUDA (and on the CPU under ``TRITON_INTERPRET=1``), from the reference elsewhere.
    ``sinks``: per source, the ``GradSink`` it was ``sinked`` with (its gradient is added there in place), or None
    (its gradient goes to autograd); the reference path gives every gradient to autograd, which is the same sum."""
    sinks = check_sources(sources, inv_rms, sinks)
    D = sources[0].shape[1]
    if query.shape != (D,) or (weight is not None and (weight.shape != (D,) or eps is None)):
        raise ValueError(f"query and weight must be [{D}] (weight with its eps), got {tuple(query.shape)} and "
                         f"{None if weight is None else tuple(weight.shape)}, eps {eps}")
    if not use_kernels(sources[0]):
        return naive_attn_res_mix(sources, inv_rms, query, weight, eps)
    tensors = [s.contiguous() for s in sources] + [r.contiguous() for r in inv_rms]
    return AttnResMix.apply(query, weight, 0.0 if eps is None else float(eps), sinks, *tensors)


def use_kernels(x: torch.Tensor) -> bool:
    """The kernels run on CUDA (and under the interpreter) up to ``MAX_WIDTH`` columns; the references elsewhere."""
    return (x.is_cuda or INTERPRET) and x.shape[1] <= MAX_WIDTH


def check_sources(sources: Sequence[torch.Tensor], inv_rms: Sequence[torch.Tensor],
                  sinks: Sequence[GradSink | None] | None) -> tuple[GradSink | None, ...]:
    """Sources ``[T, d]`` of one dtype with their float32 inv_rms ``[T]`` and one sink (or None) each, sinked ones
    contiguous; a ``ValueError`` naming what is wrong otherwise. Returns the sinks, None for each when not given."""
    n = len(sources)
    if not 1 <= n <= MAX_SOURCES or len(inv_rms) != n:
        raise ValueError(f"need 1..{MAX_SOURCES} sources and one inv_rms each, got {n} and {len(inv_rms)}")
    T, D = sources[0].shape
    if any(s.shape != (T, D) or s.dtype != sources[0].dtype for s in sources):
        raise ValueError(f"sources must all be [T, d] = [{T}, {D}] of one dtype, got "
                         f"{[(tuple(s.shape), s.dtype) for s in sources]}")
    if any(r.shape != (T,) or r.dtype != torch.float32 for r in inv_rms):
        raise ValueError(f"inv_rms must be float32 [T] = [{T}], got {[(tuple(r.shape), r.dtype) for r in inv_rms]}")
    sinks = (None,) * n if sinks is None else tuple(sinks)
    if len(sinks) != n:
        raise ValueError(f"sinks: need one per source (a GradSink or None), got {len(sinks)} for {n} sources")
    if any(sink is not None and not s.is_contiguous() for s, sink in zip(sources, sinks)):
        raise ValueError("sinks: a sinked source must be contiguous (its gradient is summed in place in its layout)")
    return sinks
