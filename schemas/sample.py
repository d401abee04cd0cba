"""``PackedSampleMeta``: the ``<key>.meta.json`` member of one WebDataset sample, and the member names of a sample.

A sample is ``<key>.tokens.npy`` (uint32, exactly ``seq_len`` long, padding included), ``<key>.meta.json`` and one
image member per image span (``img0000.jpg`` …). The writer (pipeline) and the readers (loader, inspect) both take the
names and rules from here.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from schemas.errors import SchemaError, parse_json, require, require_int

__all__ = [
    "TOKENS_MEMBER",
    "META_MEMBER",
    "IMAGE_EXTENSIONS",
    "LOSS_MASK_RULE",
    "image_member",
    "validate_key",
    "ImageSpan",
    "PieceProvenance",
    "PackedSampleMeta",
]

TOKENS_MEMBER = "tokens.npy"
META_MEMBER = "meta.json"
IMAGE_EXTENSIONS = ("jpg", "png")
_IMAGE_MEMBER = re.compile(r"^img(\d{4})\.(jpg|png)$")
_KEY = re.compile(r"^[A-Za-z0-9_\-]+$")
# Labels are ignored on <|image_start|>, <|image_pad|>, <|image_end|>, on padding, and on the first token of each
# piece (nothing precedes it inside its document piece); every other token is predicted.
LOSS_MASK_RULE = "text-only/v1"


def image_member(index: int, ext: str) -> str:
    """Member suffix of the ``index``-th image of a sample, e.g. ``img0003.png``."""
    if ext not in IMAGE_EXTENSIONS:
        raise ValueError(f"image extension must be one of {IMAGE_EXTENSIONS}, got {ext!r}")
    return f"img{index:04d}.{ext}"


def validate_key(key: object) -> str:
    """A sample key: letters, digits, ``_`` and ``-`` only (no dots, no path separators)."""
    require(isinstance(key, str) and bool(_KEY.match(key)), f"sample {key!r}", "key",
            "must match [A-Za-z0-9_-]+ (no dots, no slashes)")
    return key  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True, slots=True)
class ImageSpan:
    """``start``: position of the first ``<|image_pad|>``; ``n_tokens == grid_h * grid_w`` merged patches."""

    start: int
    n_tokens: int
    grid_h: int
    grid_w: int

    def to_list(self) -> list[int]:
        return [self.start, self.n_tokens, self.grid_h, self.grid_w]


@dataclasses.dataclass(frozen=True, slots=True)
class PieceProvenance:
    """Where a piece came from: the source document, its piece index, and its token range in the whole document."""

    doc_id: str
    piece_index: int
    token_start: int
    token_end: int

    def to_list(self) -> list[Any]:
        return [self.doc_id, self.piece_index, [self.token_start, self.token_end]]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PackedSampleMeta:
    """Metadata of one packed sample. ``cu_seqlens`` has one entry per piece boundary; ``cu_seqlens[-1]`` is the
    number of non-padding tokens, and positions from there to ``seq_len`` are padding."""

    key: str
    stage: str
    seq_len: int
    cu_seqlens: tuple[int, ...]
    provenance: tuple[PieceProvenance, ...]
    image_spans: tuple[ImageSpan, ...]
    image_members: tuple[str, ...]
    loss_mask: str = LOSS_MASK_RULE

    @property
    def record(self) -> str:
        return f"sample {self.key!r}"

    @property
    def used_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def pad_tokens(self) -> int:
        return self.seq_len - self.cu_seqlens[-1]

    def validate(self) -> PackedSampleMeta:
        record = self.record
        validate_key(self.key)
        require(isinstance(self.stage, str) and bool(self.stage), record, "stage", "must be a non-empty str")
        require_int(self.seq_len, record, "seq_len", minimum=1)
        cu = self.cu_seqlens
        require(len(cu) >= 2 and cu[0] == 0, record, "cu_seqlens", f"must start at 0 and hold >= 2 entries, got {list(cu)[:4]}")
        for i, (a, b) in enumerate(zip(cu, cu[1:])):
            require_int(b, record, f"cu_seqlens[{i + 1}]")
            require(b > a, record, f"cu_seqlens[{i + 1}]", f"must be increasing, got {a} then {b}")
        require(cu[-1] <= self.seq_len, record, "cu_seqlens", f"last entry {cu[-1]} exceeds seq_len {self.seq_len}")
        require(len(self.provenance) == len(cu) - 1, record, "provenance",
                f"needs one entry per piece ({len(cu) - 1}), got {len(self.provenance)}")
        for i, p in enumerate(self.provenance):
            require(isinstance(p.doc_id, str) and bool(p.doc_id), record, f"provenance[{i}].doc_id", "must be a non-empty str")
            require_int(p.piece_index, record, f"provenance[{i}].piece_index")
            require(p.token_end - p.token_start == cu[i + 1] - cu[i], record, f"provenance[{i}].token_range",
                    f"length {p.token_end - p.token_start} != piece length {cu[i + 1] - cu[i]}")
        require(len(self.image_members) == len(self.image_spans), record, "image_members",
                f"needs one member per image span ({len(self.image_spans)}), got {len(self.image_members)}")
        end = 0
        for i, (span, member) in enumerate(zip(self.image_spans, self.image_members)):
            match = _IMAGE_MEMBER.match(member) if isinstance(member, str) else None
            require(match is not None and int(match.group(1)) == i, record, f"image_members[{i}]",
                    f"must be img{i:04d}.jpg or .png, got {member!r}")
            require(span.grid_h >= 1 and span.grid_w >= 1 and span.grid_h * span.grid_w == span.n_tokens, record,
                    f"image_spans[{i}]", f"n_tokens {span.n_tokens} != grid {span.grid_h}×{span.grid_w}")
            require(span.start >= end and span.start + span.n_tokens <= cu[-1], record, f"image_spans[{i}]",
                    f"span [{span.start}, {span.start + span.n_tokens}) overlaps the previous or leaves the tokens")
            end = span.start + span.n_tokens
        require(self.loss_mask == LOSS_MASK_RULE, record, "loss_mask", f"unknown rule {self.loss_mask!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "stage": self.stage,
            "seq_len": self.seq_len,
            "cu_seqlens": list(self.cu_seqlens),
            "provenance": [p.to_list() for p in self.provenance],
            "image_spans": [s.to_list() for s in self.image_spans],
            "image_members": list(self.image_members),
            "loss_mask": self.loss_mask,
        }

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, ensure_ascii=False).encode("utf-8")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PackedSampleMeta:
        require(isinstance(data, Mapping), "sample", "<root>", "meta.json must hold an object")
        record = f"sample {data.get('key')!r}"
        try:
            meta = cls(
                key=data["key"],
                stage=data["stage"],
                seq_len=data["seq_len"],
                cu_seqlens=tuple(data["cu_seqlens"]),
                provenance=tuple(PieceProvenance(d, i, r[0], r[1]) for d, i, r in data["provenance"]),
                image_spans=tuple(ImageSpan(*s) for s in data["image_spans"]),
                image_members=tuple(data["image_members"]),
                loss_mask=data["loss_mask"],
            )
        except KeyError as exc:
            raise SchemaError(record, str(exc.args[0]), "missing") from None
        except (TypeError, ValueError, IndexError) as exc:
            raise SchemaError(record, "<root>", f"malformed meta.json ({exc})") from None
        return meta.validate()

    @classmethod
    def from_json(cls, raw: bytes | str) -> PackedSampleMeta:
        return cls.from_dict(parse_json(raw, "sample", what="meta.json is "))
