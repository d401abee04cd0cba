"""``StageSpec``: one curriculum stage (8K, 64K, 256K, 1M tokens) and which document lengths it packs.

A stage takes documents by length bucket. A bucket's ``weight`` is the fraction of its documents the stage keeps
(chosen by a hash of the document id, so the choice is deterministic and independent across stages); documents longer
than ``seq_len`` are split into pieces at segment boundaries by the packer, never truncated.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from schemas.errors import SchemaError, require, require_int

__all__ = ["LengthBucket", "StageSpec", "DEFAULT_STAGES", "STAGE_ORDER", "load_stage_config"]

STAGE_ORDER = ("8k", "64k", "256k", "1m")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LengthBucket:
    """Documents with ``min_tokens <= length < max_tokens`` (``max_tokens=None``: no upper bound)."""

    min_tokens: int
    max_tokens: int | None
    weight: float = 1.0

    def contains(self, length: int) -> bool:
        return self.min_tokens <= length and (self.max_tokens is None or length < self.max_tokens)

    @property
    def name(self) -> str:
        """Short label used in shard names, e.g. ``b0-2048`` or ``b65536-inf``."""
        return f"b{self.min_tokens}-{'inf' if self.max_tokens is None else self.max_tokens}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StageSpec:
    """One stage of the curriculum: sequence length, length mixture, token budget, image limits."""

    name: str
    seq_len: int
    buckets: tuple[LengthBucket, ...]
    token_budget: int
    max_images_per_sample: int = 256
    window_docs: int = 512  # documents per packing window: bounds memory, keeps output deterministic

    def __post_init__(self) -> None:
        record = f"stage {self.name!r}"
        require(isinstance(self.name, str) and bool(self.name) and "." not in self.name, record, "name",
                "must be a non-empty str without dots")
        require_int(self.seq_len, record, "seq_len", minimum=16)
        require_int(self.token_budget, record, "token_budget", minimum=0)
        require_int(self.max_images_per_sample, record, "max_images_per_sample", minimum=0)
        require_int(self.window_docs, record, "window_docs", minimum=1)
        require(len(self.buckets) > 0, record, "buckets", "a stage needs at least one length bucket")
        previous_end = 0
        for i, bucket in enumerate(self.buckets):
            field = f"buckets[{i}]"
            require(isinstance(bucket, LengthBucket), record, field, f"must be a LengthBucket, got {bucket!r}")
            require_int(bucket.min_tokens, record, f"{field}.min_tokens")
            require(bucket.min_tokens == previous_end, record, f"{field}.min_tokens",
                    f"buckets must be contiguous: expected {previous_end}, got {bucket.min_tokens}")
            require(bucket.max_tokens is None or bucket.max_tokens > bucket.min_tokens, record, f"{field}.max_tokens",
                    f"must exceed min_tokens {bucket.min_tokens}, got {bucket.max_tokens}")
            require(isinstance(bucket.weight, (int, float)) and 0.0 <= bucket.weight <= 1.0 and not math.isnan(bucket.weight),
                    record, f"{field}.weight", f"must lie in [0, 1], got {bucket.weight!r}")
            require(bucket.max_tokens is not None or i == len(self.buckets) - 1, record, f"{field}.max_tokens",
                    "only the last bucket may be unbounded")
            previous_end = bucket.max_tokens if bucket.max_tokens is not None else previous_end

    def bucket_of(self, length: int) -> LengthBucket | None:
        """The bucket holding a document of ``length`` tokens, or None when the stage does not take that length."""
        return next((b for b in self.buckets if b.contains(length)), None)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageSpec:
        record = f"stage {data.get('name')!r}"
        require(isinstance(data, Mapping), record, "<root>", "must be a mapping")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        require(not unknown, record, unknown[0] if unknown else "", "unknown key")
        buckets = data.get("buckets")
        require(isinstance(buckets, Sequence) and not isinstance(buckets, str), record, "buckets", "must be a list")
        try:
            parsed = tuple(LengthBucket(**b) for b in buckets)
        except TypeError as exc:
            raise SchemaError(record, "buckets", str(exc)) from None
        return cls(**{**data, "buckets": parsed})


def _stage(name: str, seq_len: int, buckets: list[tuple[int, int | None, float]], token_budget: int) -> StageSpec:
    return StageSpec(
        name=name,
        seq_len=seq_len,
        buckets=tuple(LengthBucket(min_tokens=lo, max_tokens=hi, weight=w) for lo, hi, w in buckets),
        token_budget=token_budget,
    )


# The curriculum of the source article: 8K, then 64K, 256K and 1M tokens. Documents of one bucket pack together, so
# few buckets pack tightest: the 8K stage packs every document in one bucket (long ones split into pieces, short ones
# filling the gaps); the long stages keep every long document and a quarter of the shorter ones.
DEFAULT_STAGES: dict[str, StageSpec] = {
    "8k": _stage("8k", 8192, [(0, None, 1.0)], token_budget=1_000_000_000_000),
    "64k": _stage("64k", 65536, [(0, 8192, 0.25), (8192, None, 1.0)], token_budget=200_000_000_000),
    "256k": _stage("256k", 262144, [(0, 65536, 0.25), (65536, None, 1.0)], token_budget=50_000_000_000),
    "1m": _stage("1m", 1048576, [(0, 262144, 0.25), (262144, None, 1.0)], token_budget=20_000_000_000),
}


def load_stage_config(path: str | Path) -> dict[str, StageSpec]:
    """Read a YAML file ``{stages: [{name, seq_len, buckets: [{min_tokens, max_tokens, weight}], ...}]}``."""
    import yaml  # only the config path needs YAML

    text = Path(path).read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    stages = data.get("stages") if isinstance(data, Mapping) else None
    if not isinstance(stages, list) or not stages:
        raise SchemaError(f"stage config {str(path)!r}", "stages", "must be a non-empty list")
    specs = [StageSpec.from_dict(s) for s in stages]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise SchemaError(f"stage config {str(path)!r}", "stages", f"duplicate stage names in {names}")
    return {s.name: s for s in specs}
