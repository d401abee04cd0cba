"""Long sequences through `chunk_kda` in checkpointed segments, so the backward holds one segment's intermediates.

Besides its inputs, `chunk_kda` keeps per token the normalised q and k, A_qk, the UT inverse, w, v_new and the chunk
states h (about 14 KB at 8 heads of 128, bf16), and its backward adds dh, dv_new, the float32 Gram gradients and
the input gradients (about 20 KB more): 34 GiB at 1M tokens, for one layer. In segments of S tokens, each under a
non-reentrant activation checkpoint, only the segment inputs are kept; the backward recomputes one segment's
forward at a time, last segment first. A document crossing a segment boundary carries its state through: the final
state of the segment where it is cut is the initial state of its rest, and gradients flow back through that link
(the kernels return dh0 and take dht). Costs one extra KDA forward for the sequences it applies to (T > S).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from kernels.kda.chunk import chunk_kda
from kernels.kda.host_cache import HOST_CU_SEQLENS
from kernels.kda.naive import CHUNK


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """Tokens [start, end) and the non-empty documents in them: global index, local cu_seqlens, whether the first
    one continues from the previous segment and which of them end here."""

    start: int
    end: int
    docs: list[int]
    cu: list[int]
    continues: bool
    ends: list[bool]


def plan_segments(cu_seqlens: list[int], size: int) -> list[Segment]:
    """Cut [0, T) into segments of `size` tokens (a multiple of the 64-token chunk) over the documents of
    cu_seqlens [N+1]; empty documents belong to no segment."""
    if size < CHUNK or size % CHUNK:
        raise ValueError(f"segment size must be a positive multiple of {CHUNK} tokens, got {size}")
    T = cu_seqlens[-1]
    bounds = list(zip(cu_seqlens[:-1], cu_seqlens[1:]))
    segments = []
    for start in range(0, T, size):
        end = min(start + size, T)
        docs = [d for d, (s, e) in enumerate(bounds) if s < end and e > start]
        cu = [max(bounds[d][0], start) - start for d in docs] + [end - start]
        segments.append(Segment(start, end, docs, cu, bounds[docs[0]][0] < start, [bounds[d][1] <= end for d in docs]))
    return segments


def scan_segments(segments: list[Segment], n_docs: int, initial_state: torch.Tensor | None,
                  like: torch.Tensor, state_shape: tuple[int, int, int],
                  run: Callable[[int, Segment, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Drive `run(i, segment, h0) -> (output, final states of the segment's documents)` over `segments` (from
    `plan_segments`), last state of a cut document in as the first initial state of the next segment. Returns the
    outputs and each of the `n_docs` documents' final states (an empty document ends where it began). `run` owns the
    checkpointing, so a caller can checkpoint more than the kernel (the model's KDA layer runs its projections per
    segment too)."""
    H, K, V = state_shape
    zero = like.new_zeros(1, H, K, V, dtype=torch.float32)
    finals: list[torch.Tensor | None] = [None] * n_docs
    outputs, carried = [], None
    for i, seg in enumerate(segments):
        first = [carried] if seg.continues else []
        rest = seg.docs[len(first):]
        starts = initial_state[rest].float() if initial_state is not None else zero.expand(len(rest), H, K, V)
        h0 = torch.cat([*first, starts]) if first else starts.contiguous()
        o, ht = run(i, seg, h0)
        outputs.append(o)
        for j, d in enumerate(seg.docs):
            if seg.ends[j]:
                finals[d] = ht[j]
        carried = None if seg.ends[-1] else ht[-1:]
    for d, final in enumerate(finals):
        if final is None:
            finals[d] = initial_state[d].float() if initial_state is not None else zero[0]
    return outputs, finals


def chunk_kda_segmented(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    segment_tokens: int | None,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_kda` with the same arguments and results, run in checkpointed segments of `segment_tokens` when the
    (packed) sequence is longer than that (None: never); B must be 1 when it is (pack batches with cu_seqlens)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if segment_tokens is None or T <= segment_tokens:
        return chunk_kda(q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=initial_state,
                         output_final_state=output_final_state, A_log=A_log, dt_bias=dt_bias, **kwargs)
    if B != 1:
        raise ValueError(f"segments need one packed sequence (B == 1 with cu_seqlens), got B={B}")
    cu = HOST_CU_SEQLENS.get(cu_seqlens).tolist() if cu_seqlens is not None else [0, T]
    # split, not slices: its backward concatenates the pieces' gradients once, where every slice's backward would
    # allocate a whole-sequence gradient to add into.
    segments = plan_segments(cu, segment_tokens)
    pieces = list(zip(*(x.split([seg.end - seg.start for seg in segments], 1) for x in (q, k, v, g, beta))))

    def run(i: int, seg: Segment, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return checkpoint(_segment, *pieces[i], h0, torch.tensor(seg.cu, dtype=torch.int32), A_log, dt_bias,
                          kwargs, use_reentrant=False)

    outputs, finals = scan_segments(segments, len(cu) - 1, initial_state, q, (H, K, V), run)
    return torch.cat(outputs, 1), torch.stack(finals) if output_final_state else None


def _segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             h0: torch.Tensor, cu: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
             kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One segment: its documents from h0, every final state out (the last may continue in the next segment)."""
    return chunk_kda(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                     A_log=A_log, dt_bias=dt_bias, **kwargs)
