"""The packed token sequence every decoder layer reads: document boundaries, positions inside documents, and the
causal document mask, built once per forward and shared by all layers."""
from __future__ import annotations

import dataclasses

import torch

from vision.attention import DocumentMask, document_ids, document_mask

__all__ = ["PackedSequence", "packed_sequence"]


@dataclasses.dataclass(frozen=True, slots=True)
class PackedSequence:
    """``cu_seqlens`` int32 ``[S+1]`` over the flattened ``T`` tokens, on the tokens' device, and ``host_cu_seqlens``
    the same on the CPU (what the KDA kernel reads its chunk table from, so no layer waits for the GPU to fetch it);
    ``positions`` int64 ``[T]`` (offset of each token inside its document, for the short convolutions); ``mask`` the
    causal document mask (None when no layer attends)."""

    cu_seqlens: torch.Tensor
    host_cu_seqlens: torch.Tensor
    positions: torch.Tensor
    mask: DocumentMask | None

    @property
    def length(self) -> int:
        return int(self.positions.shape[0])


def packed_sequence(cu_seqlens: torch.Tensor, total: int, *, with_mask: bool,
                    device: torch.device | str | None = None) -> PackedSequence:
    """Boundaries for ``total`` flattened tokens on ``device`` (default: cu_seqlens'); ``cu_seqlens`` must run from 0
    to ``total`` (padding as its own segment), so every token belongs to exactly one segment and no state or
    attention crosses a boundary. It is checked on the host: a CPU ``cu_seqlens`` costs no host-device sync at all,
    a CUDA one costs one (here, once per step, instead of in every layer)."""
    device = torch.device(cu_seqlens.device if device is None else device)
    host = cu_seqlens.to("cpu", torch.int32)
    if host.ndim != 1 or host.numel() < 2 or int(host[0]) != 0 or int(host[-1]) != total:
        raise ValueError(f"cu_seqlens: must be 1-D and run from 0 to the flattened length {total}, "
                         f"got {host.tolist()[:8]}")
    if bool((host[1:] <= host[:-1]).any()):
        raise ValueError(f"cu_seqlens: must be strictly increasing, got {host.tolist()[:8]}")
    cu = host.to(device, non_blocking=True)
    starts = cu[:-1].long()
    positions = torch.arange(total, device=device) - starts[document_ids(cu, total).long()]
    mask = document_mask(host, total, causal=True, device=device) if with_mask else None
    return PackedSequence(cu_seqlens=cu, host_cu_seqlens=host, positions=positions, mask=mask)
