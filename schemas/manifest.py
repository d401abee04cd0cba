"""``ShardManifest``: ``<stage>/manifest.json``, the table of contents and the reconciliation record of one stage.

``inspect --verify`` and the loader trust nothing in a shard they cannot check against this file.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from schemas.errors import SchemaError, parse_json, require, require_int
from schemas.stage import StageSpec

__all__ = ["MANIFEST_NAME", "MANIFEST_VERSION", "ShardEntry", "DocumentCounts", "ShardManifest"]

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ShardEntry:
    """One shard: ``path`` relative to the stage folder (a plain file name, never escaping it)."""

    path: str
    samples: int
    tokens: int
    pad_tokens: int
    images: int
    bytes: int
    sha256: str

    def validate(self, record: str, field: str) -> None:
        p = PurePosixPath(self.path) if isinstance(self.path, str) else None
        require(p is not None and len(p.parts) == 1 and p.name not in ("", ".", "..") and p.suffix == ".tar",
                record, f"{field}.path", f"must be a plain .tar file name, got {self.path!r}")
        for name in ("samples", "tokens", "pad_tokens", "images", "bytes"):
            require_int(getattr(self, name), record, f"{field}.{name}")
        require(self.pad_tokens <= self.tokens, record, f"{field}.pad_tokens", "exceeds tokens")
        require(isinstance(self.sha256, str) and bool(_SHA256.match(self.sha256)), record, f"{field}.sha256",
                f"must be 64 lowercase hex digits, got {self.sha256!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DocumentCounts:
    """Reconciliation: every input document is packed (all its tokens, in one or more pieces) or dead-lettered."""

    input: int
    packed: int
    dead_lettered: int
    not_selected: int  # valid documents this stage's length mixture did not take

    def validate(self, record: str) -> None:
        for name in ("input", "packed", "dead_lettered", "not_selected"):
            require_int(getattr(self, name), record, f"documents.{name}")
        require(self.packed + self.dead_lettered + self.not_selected == self.input, record, "documents",
                f"packed {self.packed} + dead_lettered {self.dead_lettered} + not_selected {self.not_selected}"
                f" != input {self.input}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ShardManifest:
    stage: StageSpec
    shards: tuple[ShardEntry, ...]
    tokenizer_fingerprint: str
    vision_fingerprint: str
    input_fingerprint: str
    documents: DocumentCounts
    dead_letters: Mapping[str, int]
    packing: Mapping[str, Any]  # fill ratio, pieces per document, padding, baseline comparison
    format_version: int = MANIFEST_VERSION

    @property
    def record(self) -> str:
        return f"manifest of stage {self.stage.name!r}"

    @property
    def total_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    def validate(self) -> ShardManifest:
        record = self.record
        require(self.format_version == MANIFEST_VERSION, record, "format_version",
                f"expected {MANIFEST_VERSION}, got {self.format_version!r}")
        for name in ("tokenizer_fingerprint", "vision_fingerprint", "input_fingerprint"):
            value = getattr(self, name)
            require(isinstance(value, str) and bool(_SHA256.match(value)), record, name,
                    f"must be a sha256 hex digest, got {value!r}")
        paths = [s.path for s in self.shards]
        require(len(set(paths)) == len(paths), record, "shards", "duplicate shard paths")
        for i, shard in enumerate(self.shards):
            shard.validate(record, f"shards[{i}]")
            require(shard.tokens == shard.samples * self.stage.seq_len, record, f"shards[{i}].tokens",
                    f"{shard.tokens} != samples {shard.samples} × seq_len {self.stage.seq_len}")
        self.documents.validate(record)
        for reason, count in self.dead_letters.items():
            require(isinstance(reason, str) and bool(reason), record, "dead_letters", f"bad reason {reason!r}")
            require_int(count, record, f"dead_letters.{reason}")
        require(sum(self.dead_letters.values()) == self.documents.dead_lettered, record, "dead_letters",
                f"counts sum to {sum(self.dead_letters.values())}, documents.dead_lettered is "
                f"{self.documents.dead_lettered}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "stage": self.stage.to_dict(),
            "shards": [dataclasses.asdict(s) for s in self.shards],
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "vision_fingerprint": self.vision_fingerprint,
            "input_fingerprint": self.input_fingerprint,
            "documents": dataclasses.asdict(self.documents),
            "dead_letters": dict(sorted(self.dead_letters.items())),
            "packing": dict(self.packing),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardManifest:
        require(isinstance(data, Mapping), "manifest", "<root>", "must be an object")
        record = "manifest"
        try:
            stage = StageSpec.from_dict(data["stage"])
            record = f"manifest of stage {stage.name!r}"
            manifest = cls(
                format_version=data["format_version"],
                stage=stage,
                shards=tuple(ShardEntry(**s) for s in data["shards"]),
                tokenizer_fingerprint=data["tokenizer_fingerprint"],
                vision_fingerprint=data["vision_fingerprint"],
                input_fingerprint=data["input_fingerprint"],
                documents=DocumentCounts(**data["documents"]),
                dead_letters=dict(data["dead_letters"]),
                packing=dict(data["packing"]),
            )
        except KeyError as exc:
            raise SchemaError(record, str(exc.args[0]), "missing") from None
        except TypeError as exc:
            raise SchemaError(record, "<root>", f"malformed ({exc})") from None
        return manifest.validate()

    @classmethod
    def from_json(cls, raw: str | bytes) -> ShardManifest:
        return cls.from_dict(parse_json(raw, "manifest"))
