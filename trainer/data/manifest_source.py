"""The sample index of one stage, taken from its manifest: every sample is ``(shard, index in shard)``.

The split over ranks needs only the per-shard counts, which the manifest holds, so building the plan reads no tar.
The shards themselves are opened lazily by the workers (:mod:`trainer.data.tar_index`), which check each shard
against the count and size recorded here before trusting it.
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np

from schemas.manifest import MANIFEST_NAME, ShardManifest

__all__ = ["ShardSource", "ManifestSource"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ShardSource:
    """One shard as the loader sees it: absolute ``path``, ``name`` as in the manifest, and what it must hold."""

    path: str
    name: str
    samples: int
    bytes: int


class ManifestSource:
    """A stage's manifest, its shards, and the map from a global sample id to ``(shard, index in shard)``.

    Global sample ids number the samples shard by shard in manifest order: shard ``s`` holds ids
    ``[offsets[s], offsets[s + 1])``. ``fingerprint`` (sha256 of the manifest file) tags loader state, so a state
    saved on one stage's shards cannot be restored onto another's.
    """

    def __init__(self, manifest_path: str | Path) -> None:
        path = Path(manifest_path)
        if path.is_dir():
            path = path / MANIFEST_NAME
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"manifest_path: cannot read {str(path)!r} ({exc.strerror})") from None
        self.path = path
        self.manifest = ShardManifest.from_json(raw)
        self.fingerprint = hashlib.sha256(raw).hexdigest()
        stage_dir = path.parent
        self.shards = tuple(
            ShardSource(path=str(stage_dir / s.path), name=s.path, samples=s.samples, bytes=s.bytes)
            for s in self.manifest.shards
        )
        counts = np.array([s.samples for s in self.shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self.total_samples == 0:
            raise ValueError(f"manifest_path: {str(path)!r} lists no samples")

    @property
    def seq_len(self) -> int:
        return self.manifest.stage.seq_len

    @property
    def stage(self) -> str:
        return self.manifest.stage.name

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(s.samples for s in self.shards)

    @property
    def total_samples(self) -> int:
        return int(self.offsets[-1])

    def locate(self, sample_id: int) -> tuple[int, int]:
        """``(shard index, index inside the shard)`` of a global sample id."""
        if not 0 <= sample_id < self.total_samples:
            raise IndexError(f"sample_id: must lie in [0, {self.total_samples}), got {sample_id}")
        shard = int(np.searchsorted(self.offsets, sample_id, side="right")) - 1
        return shard, sample_id - int(self.offsets[shard])
