"""Per-document steps between reading and packing: resolve and decode images, then tokenize.

Both are plain functions (the Beam DoFns in ``transforms`` only hold their per-worker state) returning either the next
record or a ``DeadLetter``.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from pipeline.dead_letters import DeadLetter
from pipeline.images import ImageCache, ImageError, resolve_image_ref
from schemas.document import Document
from schemas.errors import SchemaError
from schemas.sample import ImageSpan
from tokenization.tokenizer import TextTokenizer
from vision.geometry import VisionPolicy

__all__ = ["TokenizedDocument", "decode_document_images", "tokenize_document", "image_ext"]


def image_ext(data: bytes) -> str:
    """Member extension of an image the pipeline encoded (it writes only JPEG and PNG)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8"):
        return "jpg"
    raise ValueError("not an image this pipeline encoded (expected JPEG or PNG bytes)")


@dataclasses.dataclass(frozen=True, slots=True)
class TokenizedDocument:
    """A document as token ids with its resized images: what the packer consumes.

    ``ids`` uint32 [n]; ``image_spans`` positions of each image's pad tokens; ``segment_ends`` token offset after each
    segment (split points); ``images`` the encoded resized images, in span order.
    """

    id: str
    source: str
    ids: np.ndarray
    image_spans: tuple[ImageSpan, ...]
    segment_ends: tuple[int, ...]
    images: tuple[bytes, ...]

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def decode_document_images(doc: Document, image_root: Path | None, cache: ImageCache) -> Document | DeadLetter:
    """Every image replaced by its resized encoding (``width``/``height`` set); the first bad image dead-letters."""
    segments = []
    for i, seg in enumerate(doc.segments):
        if seg.kind != "image":
            segments.append(seg)
            continue
        try:
            data = seg.image_bytes if seg.image_bytes is not None else resolve_image_ref(seg.image_ref, image_root)
            decoded = cache.decode(data)
        except ImageError as exc:
            where = f"segments[{i}]" + (f" ({seg.image_ref})" if seg.image_ref else "")
            return DeadLetter(doc_id=doc.id, source=doc.source, reason=exc.reason, detail=f"{where}: {exc.detail}")
        segments.append(dataclasses.replace(seg, image_bytes=decoded.data, width=decoded.width, height=decoded.height))
    return dataclasses.replace(doc, segments=tuple(segments))


def tokenize_document(doc: Document, tokenizer: TextTokenizer, policy: VisionPolicy) -> TokenizedDocument | DeadLetter:
    try:
        layout = tokenizer.encode_document(doc, policy)
    except SchemaError as exc:
        return DeadLetter(doc_id=doc.id, source=doc.source, reason="bad_image_shape", detail=str(exc))
    return TokenizedDocument(
        id=doc.id,
        source=doc.source,
        ids=layout.ids,
        image_spans=layout.image_spans,
        segment_ends=layout.segment_ends,
        images=tuple(s.image_bytes for s in doc.segments if s.kind == "image"),
    )
