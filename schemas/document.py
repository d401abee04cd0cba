"""``Document``: one interleaved image-text document, the unit every reader produces and the tokenizer consumes.

The same records round-trip through JSON (JSONL of segments, dead letters) and through parquet (``DOCUMENT_SCHEMA``),
and both directions validate, so a malformed row fails with the document id and the field named.
"""
from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import pyarrow as pa

from schemas.errors import SchemaError, parse_json, require, require_int

__all__ = ["Segment", "Document", "DOCUMENT_SCHEMA", "SEGMENT_TYPE", "documents_to_table", "table_to_documents"]

SegmentKind = Literal["text", "image"]

SEGMENT_TYPE = pa.struct(
    [
        pa.field("kind", pa.string(), nullable=False),
        pa.field("text", pa.string()),
        pa.field("image_bytes", pa.binary()),
        pa.field("image_ref", pa.string()),
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
    ]
)

DOCUMENT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("segments", pa.list_(SEGMENT_TYPE), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),  # JSON object, kept as text so any keys survive
    ]
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """One ordered piece of a document: text, or an image given by bytes and/or a reference under an input root.

    ``width``/``height`` are the decoded pixel size, set once the image has been decoded (both or neither).
    """

    kind: SegmentKind
    text: str | None = None
    image_bytes: bytes | None = None
    image_ref: str | None = None
    width: int | None = None
    height: int | None = None

    @classmethod
    def of_text(cls, text: str) -> Segment:
        return cls(kind="text", text=text)

    @classmethod
    def of_image(
        cls, *, data: bytes | None = None, ref: str | None = None, width: int | None = None, height: int | None = None
    ) -> Segment:
        return cls(kind="image", image_bytes=data, image_ref=ref, width=width, height=height)

    def validate(self, record: str, field: str) -> None:
        require(self.kind in ("text", "image"), record, f"{field}.kind", f"must be 'text' or 'image', got {self.kind!r}")
        if self.kind == "text":
            require(isinstance(self.text, str), record, f"{field}.text", f"a text segment needs a str, got {self.text!r}")
            for name in ("image_bytes", "image_ref", "width", "height"):
                require(getattr(self, name) is None, record, f"{field}.{name}", "must be empty on a text segment")
            return
        require(self.text is None, record, f"{field}.text", "must be empty on an image segment")
        has_bytes = isinstance(self.image_bytes, (bytes, bytearray))
        has_ref = isinstance(self.image_ref, str) and bool(self.image_ref)
        require(self.image_bytes is None or has_bytes, record, f"{field}.image_bytes", "must be bytes")
        require(self.image_ref is None or has_ref, record, f"{field}.image_ref", "must be a non-empty str")
        require(has_bytes or has_ref, record, f"{field}.image_bytes", "an image segment needs bytes or a reference")
        require((self.width is None) == (self.height is None), record, f"{field}.width", "width and height go together")
        if self.width is not None:
            require_int(self.width, record, f"{field}.width", minimum=1)
            require_int(self.height, record, f"{field}.height", minimum=1)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: bytes as base64, empty fields left out."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.text is not None:
            out["text"] = self.text
        if self.image_bytes is not None:
            out["image_b64"] = base64.b64encode(self.image_bytes).decode("ascii")
        for name in ("image_ref", "width", "height"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], record: str, field: str) -> Segment:
        require(isinstance(data, Mapping), record, field, f"must be an object, got {type(data).__name__}")
        known = {"kind", "text", "image_b64", "image_ref", "width", "height"}
        unknown = sorted(set(data) - known)
        require(not unknown, record, f"{field}.{unknown[0] if unknown else ''}", "unknown key")
        raw = data.get("image_b64")
        payload = None
        if raw is not None:
            try:
                payload = base64.b64decode(raw, validate=True)
            except (ValueError, TypeError) as exc:
                raise SchemaError(record, f"{field}.image_b64", f"not valid base64 ({exc})") from None
        seg = cls(
            kind=data.get("kind"),  # type: ignore[arg-type]
            text=data.get("text"),
            image_bytes=payload,
            image_ref=data.get("image_ref"),
            width=data.get("width"),
            height=data.get("height"),
        )
        seg.validate(record, field)
        return seg


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Document:
    """An interleaved document. ``id`` is stable and unique within ``source``; ``metadata`` is any JSON object."""

    id: str
    source: str
    segments: tuple[Segment, ...]
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def record(self) -> str:
        return f"document {self.id!r}"

    @property
    def images(self) -> list[Segment]:
        return [s for s in self.segments if s.kind == "image"]

    def validate(self) -> Document:
        """Check every field; return self so readers can write ``Document(...).validate()``."""
        require(isinstance(self.id, str) and bool(self.id), f"document {self.id!r}", "id", "must be a non-empty str")
        require(isinstance(self.source, str) and bool(self.source), self.record, "source", "must be a non-empty str")
        require(isinstance(self.segments, tuple), self.record, "segments", "must be a tuple of Segment")
        require(len(self.segments) > 0, self.record, "segments", "document is empty")
        for i, seg in enumerate(self.segments):
            require(isinstance(seg, Segment), self.record, f"segments[{i}]", f"must be a Segment, got {seg!r}")
            seg.validate(self.record, f"segments[{i}]")
        require(isinstance(self.metadata, Mapping), self.record, "metadata", "must be a JSON object")
        try:
            json.dumps(self.metadata, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise SchemaError(self.record, "metadata", f"not JSON-serialisable ({exc})") from None
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "source": self.source,
            "segments": [s.to_dict() for s in self.segments],
            "metadata": dict(self.metadata),
        }

    def to_json(self) -> str:
        """One JSONL line (no newline); keys sorted so equal documents give equal bytes."""
        return json.dumps(self.to_dict(), sort_keys=True, ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Document:
        require(isinstance(data, Mapping), "document", "<root>", f"must be an object, got {type(data).__name__}")
        record = f"document {data.get('id')!r}"
        segments = data.get("segments")
        require(isinstance(segments, list), record, "segments", f"must be a list, got {type(segments).__name__}")
        doc = cls(
            id=data.get("id"),  # type: ignore[arg-type]
            source=data.get("source"),  # type: ignore[arg-type]
            segments=tuple(Segment.from_dict(s, record, f"segments[{i}]") for i, s in enumerate(segments)),
            metadata=data.get("metadata", {}),
        )
        return doc.validate()

    @classmethod
    def from_json(cls, line: str | bytes) -> Document:
        return cls.from_dict(parse_json(line, "document"))


def documents_to_table(documents: Iterable[Document]) -> pa.Table:
    """Columnar form for parquet; validates each document first."""
    rows = []
    for doc in documents:
        doc.validate()
        rows.append(
            {
                "id": doc.id,
                "source": doc.source,
                "segments": [
                    {f: getattr(s, f) for f in ("kind", "text", "image_bytes", "image_ref", "width", "height")}
                    for s in doc.segments
                ],
                "metadata": json.dumps(dict(doc.metadata), sort_keys=True, ensure_ascii=False),
            }
        )
    return pa.Table.from_pylist(rows, schema=DOCUMENT_SCHEMA)


def table_to_documents(table: pa.Table) -> list[Document]:
    """Inverse of :func:`documents_to_table`; every row is validated and named on failure."""
    missing = [f.name for f in DOCUMENT_SCHEMA if f.name not in table.column_names]
    if missing:
        raise SchemaError("table", missing[0], "column missing")
    docs = []
    for row in table.select([f.name for f in DOCUMENT_SCHEMA]).to_pylist():
        record = f"document {row['id']!r}"
        metadata = parse_json(row["metadata"], record, "metadata") if row["metadata"] else {}
        segments = tuple(Segment(**seg) for seg in (row["segments"] or []))
        docs.append(Document(id=row["id"], source=row["source"], segments=segments, metadata=metadata).validate())
    return docs
