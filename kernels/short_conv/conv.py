"""Causal depthwise short convolution + SiLU over packed documents: one Triton kernel forward, two backward.

Compiled from PyTorch, the shift-and-add of ``naive.py`` became three float32 pad copies and a fused kernel forward,
and three kernels backward: 220 of a 1,659 ms ``small`` step at 131K tokens (H200 profile, BENCHMARKS.md). The
forward reads x once from HBM and writes y once (the taps re-read neighbouring rows from cache). The backward
recomputes the pre-activation instead of storing it and writes da = dy · silu' once, with the weight gradient's
partial sums; a second kernel gathers dx from the W rows of da that each row's taps reached. A single backward kernel
that recomputed da for every tap (W² shifted loads per tile) took 9.0 ms at the 8k stage's shape against 1.1 ms
forward (H200, 2026-12-03).

Layout: x ``[T, C]`` may be a column slice of a wider buffer (the KDA layer's joint projection); the output is
``groups`` tensors ``[T, C // groups]``, each its own allocation (one launch per group), so q, k and v take separate
gradients. As views of one ``[groups, T, C // groups]`` buffer (until 2026-12-05) their gradients were stacked by
``unbind``'s backward (a copy of all three), and the KDA layer copied v so that the KDA kernel's saved v would not
keep q and k alive. One launch writing all three through a tuple of pointers cost the backward's first kernel its
registers (a masked load per group in flight: 255 and spills, 220-240 before).

The KDA layer L2-normalises q and k over each head after the SiLU: ``norm_groups`` does it in these kernels (the
forward's tile holds whole heads; the backward's first kernel recomputes the norm with the pre-activation), instead
of a kernel each way that read and wrote q and k again (``kernels.kda.l2norm``: 121 ms of an H100 step).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kernels.grad_sink import ColumnSink
from kernels.kda.l2norm import EPS as L2_EPS
from kernels.tuning import autotune
from kernels.short_conv.naive import naive_short_conv_silu

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_WIDTH = 8
MAX_HEAD_DIM = 128  # the head L2 norm's heads: the channel tile of each space's first entry
# Rows per program of the backward's first kernel: its weight-gradient partial dw [C, W] float32 is one per program,
# 1/64 of its da traffic at width 4.
BWD_ROWS = 512


@triton.jit
def tap_weights(w, o_c, m_c, W: tl.constexpr):
    """The W taps' weights of channels o_c, float32 ``[BC]`` each: loaded once, before a program's loop over rows."""
    ws = ()
    for i in tl.static_range(W):
        ws = ws + (tl.load(w + o_c * W + i, mask=m_c, other=0.).to(tl.float32),)
    return ws


@triton.jit
def conv_at(x, ws, pos, o_s, m_s, o_c, m_c, stride_x, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Pre-activation ``Σ_i w[c, i] x[s − i]`` of rows o_s over the taps that stay inside row s's document
    (``pos[s] ≥ i``) and the sequence (``s ≥ i``), in float32, the taps' weights ``ws`` (``tap_weights``); and
    ``pos[s]``."""
    b_pos = tl.load(pos + o_s, mask=m_s, other=0)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for i in tl.static_range(W):
        m = (m_s & (b_pos >= i) & (o_s >= i))[:, None] & m_c[None, :]
        b_x = tl.load(x + (o_s - i)[:, None] * stride_x + o_c[None, :], mask=m, other=0.).to(tl.float32)
        acc += b_x * ws[i][None, :]
    return acc, b_pos


# Tiles that ptxas (sm_90, width 4) compiles without spills (`python -m kernels.ptxas_report`): the W shifted loads of
# a tile are all in flight at once, so registers grow with the elements per thread (about 9 each forward and dx; da
# holds its [BT, WP, BC] taps and their running products, 166 to 234 registers in these four); a forward 64 × 64 tile
# with 4 warps used 255 registers and spilled. FWD_SPACE serves the dx kernel too: the same W shifted loads. Since
# each group is its own launch (2026-12-05), da's 16 × 128 tile with 4 warps and 16 × 256 with 8 spilled 172 B per
# thread (the code changed little; ptxas's choice did): 16 × 128 now runs on 8 warps, and 8 × 256 replaces 16 × 256.
# The smallest row blocks won every key the H200's tuning timed (2026-12-06, the autotuner's own timings at the 8k
# stage: forward 8 × 256 at 4 warps 0.114 ms, dx 0.109, da 8 × 128 at 4 warps 0.256), so 4-row tiles joined (96 to
# 121 registers, no spills). The first entry of each space, the one the interpreter runs (Triton prunes nothing when
# a space has one entry), holds whole heads of up to 128 channels for the head L2 norm; on a GPU ``whole_heads``
# widens the narrower tiles.
# Each program of the forward and dx kernels runs ROWS rows in blocks of BT, STAGES deep (``tl.range``); ROWS = BT
# and one stage are the single-tile programs tuned so far, of which only 8 × 256 (the H200's forward) and 4 × 512
# (the rest of both GPUs' picks) ever won and stay. One tile a program left each SM a few small tiles' loads in
# flight: the forward moved its 268 MB a call at about 2.4 TB/s on the H200 (0.114 ms), dx about the same. With more
# stages the next blocks' rows are in flight through shared memory while a block is computed. By ptxas (Triton
# 3.6, sm_90): 56-64 registers single-tile, 79-112 pipelined, no spills, 17-34 KB of shared memory. The H100's
# tuning kept one tile for the forward and dx (2026-12-07).
FWD_SPACE = [({"BT": 16, "BC": 128, "ROWS": 64, "STAGES": 2}, 4), ({"BT": 8, "BC": 256, "ROWS": 8, "STAGES": 1}, 4),
             ({"BT": 4, "BC": 512, "ROWS": 4, "STAGES": 1}, 4), ({"BT": 8, "BC": 256, "ROWS": 64, "STAGES": 2}, 4),
             ({"BT": 4, "BC": 512, "ROWS": 64, "STAGES": 2}, 4), ({"BT": 8, "BC": 256, "ROWS": 128, "STAGES": 3}, 4),
             ({"BT": 4, "BC": 512, "ROWS": 128, "STAGES": 3}, 4), ({"BT": 16, "BC": 256, "ROWS": 128, "STAGES": 2}, 8)]
# da's loop over its ROWS rows runs STAGES deep (``tl.range``): with one stage each row block waited for its loads
# (0.256 ms a call at the 8k stage on the H200 picked 8 × 128 at 4 warps for both keys: about 37% of the copy
# bandwidth for its 402 MB), with more the next blocks' taps, positions and dy are in flight through shared memory
# meanwhile. By ptxas (Triton 3.6, sm_90, C a multiple of 16 as at launch): 156-186 registers at 1 to 3 stages, no
# spills, 10-41 KB of shared memory. The H100's tuning picked 3 stages for both keys (2026-12-07).
DA_SPACE = [({"BT": 8, "BC": 128, "STAGES": 2}, 4), ({"BT": 8, "BC": 128, "STAGES": 1}, 4),
            ({"BT": 8, "BC": 128, "STAGES": 3}, 4), ({"BT": 16, "BC": 64, "STAGES": 2}, 4),
            ({"BT": 4, "BC": 256, "STAGES": 2}, 4), ({"BT": 16, "BC": 128, "STAGES": 2}, 8),
            ({"BT": 8, "BC": 256, "STAGES": 2}, 8), ({"BT": 4, "BC": 128, "STAGES": 2}, 2)]


def whole_heads(space: list[triton.Config], nargs: dict, **kwargs) -> list[triton.Config]:
    """With NORM, channel blocks rounded up to whole heads of HD channels (early_config_prune hook)."""
    if not kwargs.get("NORM"):
        return space
    hd, widened = kwargs["HD"], {}
    for c in space:
        meta = dict(c.kwargs, BC=triton.cdiv(c.kwargs["BC"], hd) * hd)
        widened.setdefault((tuple(sorted(meta.items())), c.num_warps),
                           triton.Config(meta, num_warps=c.num_warps, num_stages=c.num_stages))
    return list(widened.values())


@triton.jit
def head_l2norm(y, eps, BT: tl.constexpr, BC: tl.constexpr, HD: tl.constexpr):
    """y [BT, BC] split into heads of HD channels, and each head's row rsqrt(|y|² + eps) [BT, BC // HD]."""
    y3 = tl.reshape(y, (BT, BC // HD, HD))
    return y3, tl.rsqrt(tl.sum(y3 * y3, 2) + eps)


@autotune(FWD_SPACE, key=["C", "W", "NORM"], prune_configs_by={"early_config_prune": whole_heads})
@triton.jit
def short_conv_fwd_kernel(x, w, pos, y, T, C, x_rows, eps, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                          ROWS: tl.constexpr, STAGES: tl.constexpr, X_ALIGN: tl.constexpr, NORM: tl.constexpr,
                          HD: tl.constexpr):
    """y = silu(pre-activation), divided by its L2 norm over each head of HD channels with NORM, for the program's
    ROWS rows in blocks of BT, STAGES deep."""
    stride_x = x_rows * X_ALIGN
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < C
    ws = tap_weights(w, o_c, m_c, W)
    for r in tl.range(0, ROWS // BT, num_stages=STAGES):
        o_t = tl.program_id(0).to(tl.int64) * ROWS + r * BT + tl.arange(0, BT)
        m_t = o_t < T
        acc, _ = conv_at(x, ws, pos, o_t, m_t, o_c, m_c, stride_x, W, BT, BC)
        b_y = acc * tl.sigmoid(acc)
        if NORM:
            y3, rn = head_l2norm(b_y, eps, BT, BC, HD)
            b_y = tl.reshape(y3 * rn[:, :, None], (BT, BC))
        tl.store(y + o_t[:, None] * C + o_c[None, :], b_y.to(y.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


@autotune(DA_SPACE, key=["C", "W", "NORM"], prune_configs_by={"early_config_prune": whole_heads})
@triton.jit
def short_conv_bwd_da_kernel(x, w, pos, dy, da, dw, T, C, x_rows, eps, W: tl.constexpr, WP: tl.constexpr,
                             ROWS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, X_ALIGN: tl.constexpr,
                             NORM: tl.constexpr, HD: tl.constexpr, STAGES: tl.constexpr):
    """da = dy · silu'(pre-activation) (the pre-activation recomputed, not stored) for the program's ROWS rows, and
    their weight-gradient partial dw[program, c, i] = Σ_t da[t] x[t − i] over the taps inside t's document. With
    NORM, dy is the gradient of the head-normalised output n = s r (s the SiLU, r its head's rsqrt): it reaches s as
    r (dy − n ⟨n, dy⟩), the norm recomputed here like the pre-activation.

    The taps are one [BT, WP, BC] load that gives both the pre-activation (a sum over taps) and, multiplied by da, the
    weight-gradient terms, summed elementwise over the row blocks and over rows once at the end. Reducing over rows
    per block and tap crosses warps through shared memory every time: 5.9 ms at the 8k stage's shape (H200)."""
    stride_x = x_rows * X_ALIGN
    i_t = tl.program_id(0)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    o_w = tl.arange(0, WP)
    m_c, m_w = o_c < C, o_w < W
    b_w = tl.load(w + o_c[None, :] * W + o_w[:, None], mask=m_w[:, None] & m_c[None, :], other=0.).to(tl.float32)
    b_terms = tl.zeros([BT, WP, BC], dtype=tl.float32)
    for r in tl.range(0, ROWS // BT, num_stages=STAGES):
        o_t = i_t.to(tl.int64) * ROWS + r * BT + tl.arange(0, BT)
        m_t = o_t < T
        b_pos = tl.load(pos + o_t, mask=m_t, other=0)
        o_s = o_t[:, None] - o_w[None, :]  # the row each tap reads
        m_s = m_t[:, None] & m_w[None, :] & (b_pos[:, None] >= o_w[None, :]) & (o_s >= 0)
        b_x = tl.load(x + o_s[:, :, None] * stride_x + o_c[None, None, :], mask=m_s[:, :, None] & m_c[None, None, :],
                      other=0.).to(tl.float32)
        acc = tl.sum(b_x * b_w[None, :, :], 1)
        b_dy = tl.load(dy + o_t[:, None] * C + o_c[None, :], mask=m_t[:, None] & m_c[None, :],
                       other=0.).to(tl.float32)
        sig = tl.sigmoid(acc)
        if NORM:
            s3, rn = head_l2norm(acc * sig, eps, BT, BC, HD)
            n3 = s3 * rn[:, :, None]
            dy3 = tl.reshape(b_dy, (BT, BC // HD, HD))
            b_dy = tl.reshape((dy3 - n3 * tl.sum(n3 * dy3, 2)[:, :, None]) * rn[:, :, None], (BT, BC))
        b_da = b_dy * sig * (1. + acc * (1. - sig))
        tl.store(da + o_t[:, None] * C + o_c[None, :], b_da.to(da.dtype.element_ty),
                 mask=m_t[:, None] & m_c[None, :])
        b_terms += b_da[:, None, :] * b_x
    tl.store(dw + (i_t * C + o_c)[None, :] * W + o_w[:, None], tl.sum(b_terms, 0), mask=m_w[:, None] & m_c[None, :])


@autotune(FWD_SPACE, key=["C", "W"])
@triton.jit
def short_conv_bwd_dx_kernel(da, w, pos, dx, T, C, dx_rows, W: tl.constexpr, BT: tl.constexpr,
                             BC: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr, DX_ALIGN: tl.constexpr):
    """dx[t] = Σ_j w[:, j] da[t + j] over the rows t + j whose tap j stays inside their document (pos ≥ j); dx's
    rows ``dx_rows * DX_ALIGN`` apart (a group's columns of the whole input's gradient, or of a joint projection's
    output gradient: see ``row_alignment`` for the split stride)."""
    stride_dx = dx_rows * DX_ALIGN
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < C
    ws = tap_weights(w, o_c, m_c, W)
    for r in tl.range(0, ROWS // BT, num_stages=STAGES):
        o_t = tl.program_id(0).to(tl.int64) * ROWS + r * BT + tl.arange(0, BT)
        m_t = o_t < T
        b_dx = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(W):
            o_s = o_t + j
            m_s = o_s < T
            b_pos = tl.load(pos + o_s, mask=m_s, other=0)
            b_da = tl.load(da + o_s[:, None] * C + o_c[None, :], mask=(m_s & (b_pos >= j))[:, None] & m_c[None, :],
                           other=0.)
            b_dx += b_da.to(tl.float32) * ws[j][None, :]
        tl.store(dx + o_t[:, None] * stride_dx + o_c[None, :], b_dx.to(dx.dtype.element_ty),
                 mask=m_t[:, None] & m_c[None, :])


def row_alignment(x: torch.Tensor) -> int:
    """The largest power of two up to 16 bytes' worth of elements that divides x's row stride. The kernels take the
    stride in these units (``x_rows``) and multiply it by the constexpr back, so that Triton knows the rows start
    16 bytes apart and loads them in vectors: it infers divisibility only for integer arguments divisible by 16, and
    the KDA layer's joint projection is 4,232 columns wide (q, k, v, beta, the decay's low rank, the gate), which
    gave 2-byte loads (sm_90 PTX: 68 ``ld.global.b16`` in the forward, 8 ``ld.global.v4.b32`` this way; the forward
    ran 191 us a call for 268 MB on both the H100 and the H200). ``tl.multiple_of`` on the scalar did not do it."""
    return math.gcd(x.stride(0), 16 // x.element_size())


class ShortConvSiLU(torch.autograd.Function):
    """Saves x (a view: no copy), the weight and the positions; the backward recomputes the pre-activation. Each
    group of channels is its own launch of each kernel, on column slices of x, the weight and dx. With ``grad_into``
    (a ``ColumnSink`` and the column x starts at in it), dx is written into the sink's columns, not returned. The
    first ``norm[0]`` groups are L2-normalised over heads of ``norm[1]`` channels."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,  # noqa: ANN001
                groups: int, grad_into: tuple[ColumnSink, int] | None, norm: tuple[int, int]
                ) -> tuple[torch.Tensor, ...]:
        T, CG = x.shape[0], x.shape[1] // groups
        align = row_alignment(x)
        ys = tuple(torch.empty(T, CG, dtype=x.dtype, device=x.device) for _ in range(groups))
        grid = lambda meta: (triton.cdiv(T, meta["ROWS"]), triton.cdiv(CG, meta["BC"]))  # noqa: E731
        for g, y in enumerate(ys):
            short_conv_fwd_kernel[grid](x[:, g * CG:], weight[g * CG:], positions, y, T, CG, x.stride(0) // align,
                                        L2_EPS, W=weight.shape[1], X_ALIGN=align, NORM=g < norm[0], HD=norm[1])
        ctx.save_for_backward(x, weight, positions)
        ctx.grad_into, ctx.norm = grad_into, norm
        return ys

    @staticmethod
    def backward(ctx, *dys: torch.Tensor  # noqa: ANN001
                 ) -> tuple[torch.Tensor | None, torch.Tensor, None, None, None, None]:
        x, weight, positions = ctx.saved_tensors
        (T, C), W = x.shape, weight.shape[1]
        CG = C // len(dys)
        align = row_alignment(x)
        n_programs = triton.cdiv(T, BWD_ROWS)
        if ctx.grad_into is None:
            dx = torch.empty(T, C, dtype=x.dtype, device=x.device)
        else:
            sink, start = ctx.grad_into
            dx = sink.columns(start, start + C, like=x)
        dx_align = row_alignment(dx)
        dweight = torch.empty(C, W, dtype=torch.float32, device=x.device)
        # One group's at a time. da in dy's dtype: in bf16 its rounding is that of dy itself; the weight gradient
        # uses it in float32.
        da = torch.empty(T, CG, dtype=dys[0].dtype, device=x.device)
        dw = torch.empty(n_programs, CG, W, dtype=torch.float32, device=x.device)
        for g, dy in enumerate(dys):
            cols = slice(g * CG, (g + 1) * CG)
            short_conv_bwd_da_kernel[lambda meta: (n_programs, triton.cdiv(CG, meta["BC"]))](
                x[:, cols], weight[cols], positions, dy.contiguous(), da, dw, T, CG, x.stride(0) // align, L2_EPS,
                W=W, WP=triton.next_power_of_2(W), ROWS=BWD_ROWS, X_ALIGN=align, NORM=g < ctx.norm[0], HD=ctx.norm[1])
            short_conv_bwd_dx_kernel[lambda meta: (triton.cdiv(T, meta["ROWS"]), triton.cdiv(CG, meta["BC"]))](
                da, weight[cols], positions, dx[:, cols], T, CG, dx.stride(0) // dx_align, W=W, DX_ALIGN=dx_align)
            torch.sum(dw, 0, out=dweight[cols])
        return (dx if ctx.grad_into is None else None), dweight.to(weight.dtype), None, None, None, None


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
                    groups: int = 1, grad_into: tuple[ColumnSink, int] | None = None, norm_groups: int = 0,
                    head_dim: int = 1) -> tuple[torch.Tensor, ...]:
    """``silu(Σ_j weight[:, j] · x_{t−j})`` for x ``[T, C]`` (rows any stride) and weight ``[C, width]``, where
    ``x_{t−j}`` is zero once it lies before token t's document (``positions[t] < j``, positions: the offset of each
    token in its document). Returns ``groups`` contiguous tensors ``[T, C // groups]`` (channel c in group
    ``c // (C // groups)``) in x's dtype; float32 math. ``grad_into``: x is the output of a
    ``kernels.grad_sink.sinked_joint_linear`` from column ``start`` of ``sink``'s, and x's gradient goes there
    (the kernels write it in place; the plain path returns it to autograd, which the sink then copies).
    ``norm_groups``: that many leading outputs are L2-normalised over each ``head_dim`` channels after the SiLU,
    ``y / sqrt(|y|² + 1e-6)`` in float32 (the KDA layer's q and k; ``kernels.kda.l2norm``'s formula).

    Triton on CUDA (and on the CPU under ``TRITON_INTERPRET=1``), ``naive_short_conv_silu`` elsewhere."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, C], got shape {tuple(x.shape)}")
    T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C or not 1 <= weight.shape[1] <= MAX_WIDTH:
        raise ValueError(f"weight must be [C, width] = [{C}, 1..{MAX_WIDTH}], got shape {tuple(weight.shape)}")
    if positions.shape != (T,) or positions.is_floating_point():
        raise ValueError(f"positions must be integer [T] = [{T}], got {positions.dtype} {tuple(positions.shape)}")
    if groups < 1 or C % groups:
        raise ValueError(f"groups must divide the {C} channels, got {groups}")
    if not 0 <= norm_groups <= groups or (norm_groups and ((C // groups) % head_dim or head_dim & (head_dim - 1)
                                                           or head_dim > MAX_HEAD_DIM)):
        raise ValueError(f"norm_groups must be 0..{groups} and head_dim a power of two up to {MAX_HEAD_DIM} that "
                         f"divides the {C // groups} channels of a group, got norm_groups={norm_groups}, "
                         f"head_dim={head_dim}")
    if not (x.is_cuda or INTERPRET):
        return naive_short_conv_silu(x, weight, positions, groups, norm_groups, head_dim)
    if x.stride(1) != 1:
        x = x.contiguous()
    return ShortConvSiLU.apply(x, weight.contiguous(), positions.contiguous(), groups, grad_into,
                               (norm_groups, head_dim))
