"""Residual connections between sublayers: standard pre-norm sums, or block attention residuals (arXiv 2603.15031).

Every attention and every FFN is one sublayer ``l`` with output ``v_l = f_l(h_l)``; ``v_0`` is the embedding.
Standard residuals feed ``h_l = Σ_{i<l} v_i``. Full AttnRes feeds a learned mixture instead,
``h_l = Σ_{i<l} α_{i→l} v_i`` with ``α_{i→l} = softmax_i(w_lᵀ RMSNorm(v_i))`` and a pseudo-query ``w_l`` initialised
to 0, so training starts from the uniform average. Block AttnRes keeps memory at O(blocks · d): sublayers are grouped
into blocks; inside block n their outputs are summed into a running ``b_n``; sublayer l of block n attends over the
finished blocks ``[b_0 = v_0, b_1, …, b_{n−1}]`` plus the partial ``b_n`` once it holds something. With one sublayer
per block this is exactly full AttnRes.

Both kinds share one interface, so a decoder layer does not know which it runs under: ``begin(embedding)`` → state,
``sublayer_input(state, l)`` → ``h_l``, ``normed_input(state, l, norm)`` → ``norm(h_l)`` (what a sublayer consumes),
``add(state, l, v_l)`` → state, ``output(state)`` → the final hidden state.

Block AttnRes needs each source's inv_rms. The open block's running sum gets it from the add that makes it (one
compiled kernel on CUDA for ``b + v`` and its row statistics, ``add_inv_rms``), not from a second pass over the sum; in
the backward the same fused node adds the inv_rms gradient into the sum's, so neither a separate inv_rms backward nor
autograd's add of the two gradients is launched.

A block's sublayers all attend over the same finished blocks, so from the block's start (when ``two_phase``) their
finished-blocks parts are mixed at once, each finished block read once for all of them
(``kernels.attn_res.attn_res_block_mix``), and each sublayer only merges its part with the open block
(``attn_res_merge``): the paper's two-phase computation. It keeps one ``[T, d]`` part per sublayer until the
backward, so it is used only for blocks none of whose sublayers is in a recomputed layer (``begin``'s
``recomputed_sublayers``). ``LONGWEAVE_ATTN_RES=two-phase`` or ``per-sublayer`` overrides the config (an A/B of
the two in one call).
"""
from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from kernels.attn_res import BlockMixture, GradSink, attn_res_block_mix, attn_res_merge, attn_res_mix, sinked
from vision.fusion import cuda_compiled

__all__ = ["ResidualState", "StandardResiduals", "BlockAttnRes", "SinkedAdd", "inv_rms", "add_inv_rms",
           "add_inv_rms_bwd"]


@dataclasses.dataclass(frozen=True, slots=True)
class ResidualState:
    """Between sublayers. ``blocks``: finished sources ``[T, d]`` (AttnRes), with ``inv_rms`` float32 ``[T]`` of each
    cached (their RMSNorm is needed by every later sublayer) and the ``GradSink`` each is ``sinked`` with (every later
    sublayer's mixture adds its gradient there in place); ``partial``: the running sum (the whole residual stream for
    standard residuals, the open block for AttnRes; None when no block is open), with its inv_rms when the add that
    made it computed them (``partial_inv_rms``; None: computed where needed) and, when the next mixture reads it
    one sublayer at a time, the sink its gradients meet in (``partial_sink``; ``partial`` is then ``sinked`` with it,
    and the next add's gradient is put there, see ``SinkedAdd``); ``mixture``: the open block's
    finished-blocks parts when it runs in two phases (its first sublayer ``mixture_at``), and ``two_phase_from``: the
    first sublayer a block may start at to do so."""

    blocks: tuple[torch.Tensor, ...]
    inv_rms: tuple[torch.Tensor, ...]
    partial: torch.Tensor | None
    sinks: tuple[GradSink, ...] = ()
    partial_inv_rms: torch.Tensor | None = None
    mixture: BlockMixture | None = None
    mixture_at: int = 0
    two_phase_from: int = 0
    partial_sink: GradSink | None = None


def _rsqrt_mean_square(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt((x * x).mean(-1, dtype=torch.float32) + eps)


@cuda_compiled
def inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1/rms float32 ``[T]`` of x ``[T, d]`` without a float32 copy of ``x`` (the mean accumulates in float32)."""
    return _rsqrt_mean_square(x, eps)


@cuda_compiled
def add_inv_rms(x: torch.Tensor, y: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + y`` and its inv_rms (as :func:`inv_rms`), in one pass over the sum on CUDA."""
    total = x + y
    return total, _rsqrt_mean_square(total, eps)


@cuda_compiled
def add_inv_rms_bwd(total: torch.Tensor, rms: torch.Tensor, d_total: torch.Tensor, d_rms: torch.Tensor
                    ) -> torch.Tensor:
    """The gradient of ``x + y`` (either) through ``add_inv_rms``: ``d_total - total r³ d_rms / d``, one pass."""
    acc = torch.promote_types(d_total.dtype, torch.float32)
    coef = (-(rms * rms * rms) * d_rms / total.shape[-1]).to(acc)
    return (d_total.to(acc) + total.to(acc) * coef[:, None]).to(d_total.dtype)


class SinkedAdd(torch.autograd.Function):
    """``add_inv_rms(x, y)`` where x, the open block ``sinked`` with ``sink``, is also a source of the next mixture:
    x's gradient is put in ``sink.grad`` for that mixture's backward kernel to add into in place (the mixture runs
    backward after this add: its output feeds the sublayer whose value y is; the sink's node runs after both, its
    consumers), instead of autograd adding the two ``[T, d]`` gradients. The same tensor is y's gradient: the
    sublayer's backward is done with it before the mixture adds into it. Untimed on a GPU (devrun/README.md: about
    32 ``[T, d]`` adds a micro-batch fewer)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor, sink: GradSink, eps: float  # noqa: ANN001
                ) -> tuple[torch.Tensor, torch.Tensor]:
        total, rms = add_inv_rms(x, y, eps)
        ctx.save_for_backward(total, rms)
        ctx.sink = sink
        ctx.set_materialize_grads(False)
        return total, rms

    @staticmethod
    def backward(ctx, d_total: torch.Tensor | None, d_rms: torch.Tensor | None  # noqa: ANN001
                 ) -> tuple[torch.Tensor | None, ...]:
        if d_rms is None:  # d_total may be another node's too: never handed to a kernel that adds into it
            return d_total, d_total, None, None
        total, rms = ctx.saved_tensors
        g = add_inv_rms_bwd(total, rms, torch.zeros_like(total) if d_total is None else d_total, d_rms)
        if ctx.sink.grad is None:
            ctx.sink.grad = g
            return None, g, None, None
        return g, g, None, None  # the mixture ran first: autograd sums through the sink's node


class StandardResiduals(nn.Module):
    """``h_{l+1} = h_l + v_l`` (AttnRes off)."""

    def begin(self, embedding: torch.Tensor, recomputed_sublayers: int = 0) -> ResidualState:
        return ResidualState(blocks=(), inv_rms=(), partial=embedding)

    def sublayer_input(self, state: ResidualState, index: int) -> torch.Tensor:
        assert state.partial is not None
        return state.partial

    def normed_input(self, state: ResidualState, index: int, norm: nn.RMSNorm) -> torch.Tensor:
        return norm(self.sublayer_input(state, index))

    def add(self, state: ResidualState, index: int, value: torch.Tensor) -> ResidualState:
        assert state.partial is not None
        return ResidualState(blocks=(), inv_rms=(), partial=state.partial + value)

    def output(self, state: ResidualState) -> torch.Tensor:
        assert state.partial is not None
        return state.partial


class BlockAttnRes(nn.Module):
    """Block AttnRes over ``n_sublayers`` sublayers in blocks of ``block_size``; ``queries[l]`` is ``w_l`` ``[d]``,
    ``queries[n_sublayers]`` mixes the final output. ``two_phase``: mix each block's finished-blocks parts at once
    (see the module docstring)."""

    def __init__(self, d_model: int, n_sublayers: int, block_size: int, eps: float = 1e-6,
                 two_phase: bool = False) -> None:
        super().__init__()
        if block_size < 1 or n_sublayers % block_size:
            raise ValueError(f"block_size: must divide n_sublayers={n_sublayers}, got {block_size}")
        self.n_sublayers, self.block_size, self.eps = n_sublayers, block_size, eps
        self.two_phase = {"two-phase": True, "per-sublayer": False}.get(os.environ.get("LONGWEAVE_ATTN_RES", ""),
                                                                          two_phase)
        self.queries = nn.Parameter(torch.zeros(n_sublayers + 1, d_model))

    def _inv_rms(self, x: torch.Tensor) -> torch.Tensor:
        return inv_rms(x, self.eps)

    def _sources(self, state: ResidualState) -> tuple[list[torch.Tensor], list[torch.Tensor], list[GradSink | None]]:
        """The finished blocks and the open one, their inv_rms, and their sinks (none for the open one)."""
        sources, rms = list(state.blocks), list(state.inv_rms)
        sinks: list[GradSink | None] = list(state.sinks)
        if state.partial is not None:
            sources.append(state.partial)
            rms.append(self._inv_rms(state.partial) if state.partial_inv_rms is None else state.partial_inv_rms)
            sinks.append(state.partial_sink)
        return sources, rms, sinks

    def _mix(self, state: ResidualState, query: torch.Tensor) -> torch.Tensor:
        sources, rms, sinks = self._sources(state)
        return attn_res_mix(sources, rms, query, sinks=sinks)

    def _finished(self, state: ResidualState, block: torch.Tensor, start: int, rms: torch.Tensor | None = None
                  ) -> ResidualState:
        """``state`` with ``block`` (and its inv_rms ``rms``, computed here if None) appended to the finished ones
        (through a fresh sink) and no block open; the next block, from sublayer ``start``, mixed in two phases when
        it may be."""
        sink = GradSink()
        block = sinked(block.contiguous(), sink)
        rms = self._inv_rms(block) if rms is None else rms
        state = ResidualState(blocks=state.blocks + (block,), inv_rms=state.inv_rms + (rms,), partial=None,
                              sinks=state.sinks + (sink,), two_phase_from=state.two_phase_from)
        if not self.two_phase or start < state.two_phase_from or start >= self.n_sublayers:
            return state
        mixture = attn_res_block_mix(state.blocks, state.inv_rms, self.queries[start:start + self.block_size],
                                     sinks=state.sinks)
        return dataclasses.replace(state, mixture=mixture, mixture_at=start)

    def begin(self, embedding: torch.Tensor, recomputed_sublayers: int = 0) -> ResidualState:
        """The state before sublayer 0. Blocks with a sublayer below ``recomputed_sublayers`` (those of recomputed
        layers) are mixed one sublayer at a time: their parts would outlive the recompute."""
        empty = ResidualState(blocks=(), inv_rms=(), partial=None, two_phase_from=recomputed_sublayers)
        return self._finished(empty, embedding, 0)

    def sublayer_input(self, state: ResidualState, index: int) -> torch.Tensor:
        return self._mix(state, self.queries[index])

    def normed_input(self, state: ResidualState, index: int, norm: nn.RMSNorm) -> torch.Tensor:
        """The mixture and the sublayer's norm as one kernel on CUDA (``kernels.attn_res``)."""
        sources, rms, sinks = self._sources(state)
        eps = norm.eps if norm.eps is not None else torch.finfo(sources[0].dtype).eps  # F.rms_norm's default
        if state.mixture is not None:
            return attn_res_merge(state.mixture, index - state.mixture_at, state.partial,
                                  rms[-1] if state.partial is not None else None, self.queries[index], norm.weight,
                                  eps)
        return attn_res_mix(sources, rms, self.queries[index], norm.weight, eps, sinks=sinks)

    def add(self, state: ResidualState, index: int, value: torch.Tensor) -> ResidualState:
        if state.partial is None:
            partial, rms = value.contiguous(), None
        elif state.partial_sink is not None:
            partial, rms = SinkedAdd.apply(state.partial, value, state.partial_sink, self.eps)
        else:
            partial, rms = add_inv_rms(state.partial, value, self.eps)
        if (index + 1) % self.block_size == 0:
            return self._finished(state, partial, index + 1, rms)
        if state.mixture is not None:  # a merge reads the partial through autograd
            return dataclasses.replace(state, partial=partial, partial_inv_rms=rms, partial_sink=None)
        sink = GradSink()
        return dataclasses.replace(state, partial=sinked(partial, sink), partial_inv_rms=rms, partial_sink=sink)

    def output(self, state: ResidualState) -> torch.Tensor:
        return self._mix(state, self.queries[self.n_sublayers])

    def extra_repr(self) -> str:
        return f"n_sublayers={self.n_sublayers}, block_size={self.block_size}"
