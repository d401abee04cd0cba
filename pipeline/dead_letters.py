"""Dead letters: every record that cannot be packed leaves the job here, with a reason, never silently.

``stage`` is empty for records rejected before stage assignment (they count against every stage) and names the stage
for records only one stage cannot take (an image longer than that stage's sequence, say).
"""
from __future__ import annotations

import dataclasses
import json

__all__ = ["DeadLetter", "REASONS"]

# Every reason the job emits, for docs and for `inspect` tables; tests check that each can occur.
REASONS = (
    "bad_utf8",
    "bad_json",
    "bad_record",
    "schema_error",
    "empty_document",
    "duplicate_id",
    "missing_image",
    "image_ref_escapes_root",
    "empty_image",
    "corrupt_image",
    "decompression_bomb",
    "bad_image_shape",
    "image_exceeds_seq_len",
)


@dataclasses.dataclass(frozen=True, slots=True)
class DeadLetter:
    doc_id: str  # the document id, or "<file>:<line or row>" when the record had none we could read
    source: str  # the input file the record came from
    reason: str
    detail: str
    stage: str = ""

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"unknown dead-letter reason {self.reason!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> DeadLetter:
        return cls(**json.loads(line))
