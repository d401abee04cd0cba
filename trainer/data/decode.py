"""Decoders of one packed sample's members: JSON (``meta.json``), numpy without pickle (``tokens.npy``) and PIL
images (``img0000.jpg`` …). Nothing else is ever decoded, so a shard cannot run code in the trainer.

Every check that ties the members together lives here (meta key and length, token dtype and length, one image per
span with the planned grid, ``<|image_pad|>`` tokens where the span says), so both the loader and the plain
webdataset baseline of the benchmark decode with exactly the same code and the same errors.
"""
from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping

import numpy as np
from PIL import Image

from schemas.sample import META_MEMBER, TOKENS_MEMBER, PackedSampleMeta
from tokenization.tokenizer import SpecialIds
from trainer.data.errors import sample_error
from vision.preprocess import PreprocessedImage, image_to_patches, load_image

__all__ = ["DecodedSample", "decode_tokens", "decode_sample"]

# What a corrupt member can raise from numpy, json/schemas and PIL (PIL raises SyntaxError on some broken PNGs).
_DECODE_ERRORS = (ValueError, OSError, EOFError, SyntaxError, Image.DecompressionBombError)


@dataclasses.dataclass(frozen=True, slots=True)
class DecodedSample:
    """``tokens`` uint32 ``[seq_len]``; ``images`` in span order, each with its patches and merged grid."""

    shard: str
    key: str
    tokens: np.ndarray
    meta: PackedSampleMeta
    images: tuple[PreprocessedImage, ...]


def decode_tokens(data: bytes) -> np.ndarray:
    """A ``.npy`` member as a 1-D uint32 array; ``allow_pickle=False`` turns an object array into an error."""
    tokens = np.load(io.BytesIO(data), allow_pickle=False)
    if tokens.ndim != 1 or tokens.dtype != np.uint32:
        raise ValueError(f"{TOKENS_MEMBER} must be 1-D uint32, got {tokens.dtype} {tokens.shape}")
    return tokens


def _decode(members: Mapping[str, bytes], shard: str, key: str, seq_len: int, special: SpecialIds) -> DecodedSample:
    for name in (TOKENS_MEMBER, META_MEMBER):
        if name not in members:
            raise ValueError(f"member {name!r} is missing")
    meta = PackedSampleMeta.from_json(members[META_MEMBER])
    if meta.key != key:
        raise ValueError(f"{META_MEMBER} names key {meta.key!r}")
    if meta.seq_len != seq_len:
        raise ValueError(f"{META_MEMBER} seq_len {meta.seq_len} != stage seq_len {seq_len}")
    tokens = decode_tokens(members[TOKENS_MEMBER])
    if tokens.shape[0] != seq_len:
        raise ValueError(f"{TOKENS_MEMBER} holds {tokens.shape[0]} tokens, seq_len is {seq_len}")
    images = []
    for span, name in zip(meta.image_spans, meta.image_members):
        if name not in members:
            raise ValueError(f"image member {name!r} is missing")
        if not bool((tokens[span.start:span.start + span.n_tokens] == special.image_pad).all()):
            raise ValueError(f"tokens [{span.start}, {span.start + span.n_tokens}) of {name} are not all image_pad")
        image = image_to_patches(load_image(members[name]))
        if image.grid != (span.grid_h, span.grid_w):
            raise ValueError(f"{name} decodes to grid {image.grid}, span says {(span.grid_h, span.grid_w)}")
        images.append(image)
    return DecodedSample(shard=shard, key=key, tokens=tokens, meta=meta, images=tuple(images))


def decode_sample(members: Mapping[str, bytes], *, shard: str, key: str, seq_len: int,
                  special: SpecialIds) -> DecodedSample:
    """Decode and cross-check one sample given as ``{suffix: bytes}``. Raises
    :class:`~trainer.data.errors.SampleError` naming ``shard`` and ``key`` for anything corrupt or inconsistent."""
    try:
        return _decode(members, shard, key, seq_len, special)
    except _DECODE_ERRORS as exc:
        raise sample_error(shard, key, f"{type(exc).__name__}: {exc}") from exc
