"""Packing without truncation: split documents into pieces, then best-fit decreasing into fixed-length samples.

A document longer than the sequence is cut only at segment boundaries; only a single text segment longer than the
sequence is cut at token boundaries, and an image is never cut. Pieces are packed best-fit decreasing inside one
bounded window of documents, so memory is bounded and the result depends only on the window's contents.
"""
from __future__ import annotations

import bisect
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from pipeline.documents import TokenizedDocument, image_ext
from schemas.sample import ImageSpan, PackedSampleMeta, PieceProvenance, image_member

__all__ = ["Piece", "PackedSample", "ImageTooLong", "split_document", "best_fit_decreasing", "pack_window",
           "concat_chunk_baseline", "stable_fraction"]


class ImageTooLong(ValueError):
    """An image segment longer than the stage's sequence: it cannot be placed without cutting it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    doc: TokenizedDocument
    index: int
    start: int
    end: int
    n_images: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True, slots=True)
class PackedSample:
    """One sample ready for the shard writer: ``tokens`` uint32 [seq_len], meta, and images in span order."""

    tokens: np.ndarray
    meta: PackedSampleMeta
    images: tuple[bytes, ...]


def stable_fraction(*parts: str) -> float:
    """A number in [0, 1) fixed by its inputs: deterministic sampling that no runner or worker count changes."""
    digest = hashlib.sha256("\x1f".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _images_in(starts: Sequence[int], start: int, end: int) -> int:
    """Number of image spans (by sorted start positions) that begin in ``[start, end)``."""
    return bisect.bisect_left(starts, end) - bisect.bisect_left(starts, start)


def split_document(doc: TokenizedDocument, seq_len: int, max_images: int) -> list[Piece]:
    """Greedy pieces of at most ``seq_len`` tokens and ``max_images`` images, cut only where the rules allow."""
    starts = [s.start for s in doc.image_spans]
    cuts: list[int] = []
    piece_start, piece_images, seg_start = 0, 0, 0
    for seg_end in doc.segment_ends:
        images = _images_in(starts, seg_start, seg_end)  # 1 for an image segment, 0 for text
        if seg_end - piece_start > seq_len or piece_images + images > max_images:
            if seg_start > piece_start:
                cuts.append(seg_start)
                piece_start, piece_images = seg_start, 0
            if seg_end - piece_start > seq_len:
                if images:
                    raise ImageTooLong(f"document {doc.id!r}: image segment of {seg_end - seg_start} tokens > {seq_len}")
                while seg_end - piece_start > seq_len:  # a text segment longer than the sequence
                    piece_start += seq_len
                    cuts.append(piece_start)
        piece_images += images
        seg_start = seg_end
    bounds = [0, *cuts, len(doc)]
    return [Piece(doc, i, a, b, _images_in(starts, a, b)) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def best_fit_decreasing(pieces: Sequence[Piece], seq_len: int, max_images: int) -> list[list[Piece]]:
    """Bins of pieces: each piece, longest first, goes to the fullest bin it fits (tokens and images)."""
    order = sorted(pieces, key=lambda p: (-p.length, p.doc.id, p.index))
    bins: list[list[Piece]] = []
    room: list[tuple[int, int]] = []  # sorted (free tokens, bin index)
    free_images: list[int] = []
    for piece in order:
        chosen = None
        for pos in range(bisect.bisect_left(room, (piece.length, -1)), len(room)):
            if free_images[room[pos][1]] >= piece.n_images:
                chosen = pos
                break
        if chosen is None:
            bins.append([])
            free_images.append(max_images)
            bin_index, free = len(bins) - 1, seq_len
        else:
            free, bin_index = room.pop(chosen)
        bins[bin_index].append(piece)
        free_images[bin_index] -= piece.n_images
        bisect.insort(room, (free - piece.length, bin_index))
    return bins


def _sample(key: str, stage: str, seq_len: int, pad_id: int, pieces: list[Piece]) -> PackedSample:
    tokens = np.full(seq_len, pad_id, dtype=np.uint32)
    cu, provenance, spans, members, images = [0], [], [], [], []
    for piece in pieces:
        offset = cu[-1]
        tokens[offset:offset + piece.length] = piece.doc.ids[piece.start:piece.end]
        cu.append(offset + piece.length)
        provenance.append(PieceProvenance(piece.doc.id, piece.index, piece.start, piece.end))
        for span, data in zip(piece.doc.image_spans, piece.doc.images):
            if piece.start <= span.start < piece.end:
                spans.append(ImageSpan(offset + span.start - piece.start, span.n_tokens, span.grid_h, span.grid_w))
                members.append(image_member(len(members), image_ext(data)))
                images.append(data)
    meta = PackedSampleMeta(key=key, stage=stage, seq_len=seq_len, cu_seqlens=tuple(cu), provenance=tuple(provenance),
                            image_spans=tuple(spans), image_members=tuple(members))
    return PackedSample(tokens=tokens, meta=meta.validate(), images=tuple(images))


def pack_window(docs: Sequence[TokenizedDocument], *, stage: str, bucket: str, window: int, seq_len: int,
                max_images: int, pad_id: int) -> list[PackedSample]:
    """Samples of one window, keyed ``<stage>-<bucket>-w<window>-<index>`` in a deterministic order."""
    pieces = [p for doc in sorted(docs, key=lambda d: d.id) for p in split_document(doc, seq_len, max_images)]
    bins = best_fit_decreasing(pieces, seq_len, max_images)
    return [_sample(f"{stage}-{bucket}-w{window:06d}-{i:06d}", stage, seq_len, pad_id, b) for i, b in enumerate(bins)]


def concat_chunk_baseline(lengths: Sequence[int], seq_len: int) -> tuple[int, int]:
    """The usual concatenate-and-chunk packing of the same documents: ``(samples, documents cut)``."""
    cut, position = 0, 0
    for n in lengths:
        if n and position // seq_len != (position + n - 1) // seq_len:
            cut += 1
        position += n
    return -(-position // seq_len), cut
