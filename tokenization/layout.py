"""The token layout of one document, shared by the pipeline (to plan) and the model (to check).

``<|bos|>`` text … ``<|image_start|>`` N × ``<|image_pad|>`` ``<|image_end|>`` … ``<|eos|>``, with N from
:func:`vision.geometry.image_tokens` of the decoded image size. ``segment_ends`` lets the packer split a document only
at segment boundaries: entry i is the token offset just after segment i (BOS counts with the first segment and EOS
with the last).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from schemas.document import Document
from schemas.errors import SchemaError
from schemas.sample import ImageSpan
from tokenization.tokenizer import TextTokenizer
from vision.geometry import DEFAULT_POLICY, GeometryError, VisionPolicy, merged_grid

__all__ = ["TokenLayout", "encode_document"]


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLayout:
    """``ids`` uint32 [n]; ``image_spans`` in order (start = first pad position); ``segment_ends`` [n_segments]."""

    ids: np.ndarray
    image_spans: tuple[ImageSpan, ...]
    segment_ends: tuple[int, ...]

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def encode_document(
    document: Document, tokenizer: TextTokenizer, policy: VisionPolicy = DEFAULT_POLICY
) -> TokenLayout:
    """Lay out ``document``: its images must already carry their decoded ``width``/``height``."""
    special = tokenizer.special
    texts = [s.text for s in document.segments if s.kind == "text"]
    encoded = iter(tokenizer.encode_batch(texts)) if texts else iter(())
    pieces: list[np.ndarray] = [np.array([special.bos], dtype=np.uint32)]
    spans: list[ImageSpan] = []
    ends: list[int] = []
    position = 1
    for i, seg in enumerate(document.segments):
        if seg.kind == "text":
            ids = np.asarray(next(encoded), dtype=np.uint32)
        else:
            if seg.width is None or seg.height is None:
                raise SchemaError(document.record, f"segments[{i}].width", "image is not decoded yet (no size)")
            try:
                rows, cols = merged_grid(seg.height, seg.width, policy)
            except GeometryError as exc:
                raise SchemaError(document.record, f"segments[{i}]", str(exc)) from None
            n = rows * cols
            ids = np.empty(n + 2, dtype=np.uint32)
            ids[0], ids[1:-1], ids[-1] = special.image_start, special.image_pad, special.image_end
            spans.append(ImageSpan(position + 1, n, rows, cols))
        pieces.append(ids)
        position += len(ids)
        ends.append(position)
    pieces.append(np.array([special.eos], dtype=np.uint32))
    ends[-1] += 1
    return TokenLayout(ids=np.concatenate(pieces), image_spans=tuple(spans), segment_ends=tuple(ends))
