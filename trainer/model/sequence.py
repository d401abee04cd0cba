"""The packed token sequence every decoder layer reads: document boundaries, positions inside documents, and the
causal document mask, built once per forward and shared by all layers."""
from __future__ import annotations

import dataclasses

import torch

from vision.attention import DocumentMask, document_ids, document_mask

__all__ = ["PackedSequence", "packed_sequence"]


@dataclasses.dataclass(frozen=True, slots=True)
class PackedSequence:
    """``cu_seqlens`` int32 ``[S+1]`` over the flattened ``T`` tokens; ``positions`` int64 ``[T]`` (offset of each
    token inside its document, for the short convolutions); ``mask`` the causal document mask (None when no layer
    attends)."""

    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    mask: DocumentMask | None

    @property
    def length(self) -> int:
        return int(self.positions.shape[0])


def packed_sequence(cu_seqlens: torch.Tensor, total: int, *, with_mask: bool) -> PackedSequence:
    """Boundaries for ``total`` flattened tokens; ``cu_seqlens`` must run from 0 to ``total`` (padding as its own
    segment), so every token belongs to exactly one segment and no state or attention crosses a boundary."""
    cu = cu_seqlens.to(torch.int32)
    if cu.ndim != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens: must be 1-D and run from 0 to the flattened length {total}, "
                         f"got {cu.tolist()[:8]}")
    if bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens: must be strictly increasing, got {cu.tolist()[:8]}")
    starts = cu[:-1].long()
    positions = torch.arange(total, device=cu.device) - starts[document_ids(cu, total).long()]
    mask = document_mask(cu, total, causal=True) if with_mask else None
    return PackedSequence(cu_seqlens=cu, positions=positions, mask=mask)
