"""WebDataset shard sink: deterministic tar bytes, written under a temporary name and renamed into place.

Members of a sample are sorted, every member has mtime 0 and fixed owner names, and samples keep the packer's order,
so the same samples always give the same bytes. Writes go through Beam's ``FileSystems`` so the output folder may be
local or on any filesystem Beam knows (GCS, S3, HDFS); a job killed mid-write leaves only a ``.tmp`` file, never a
partial file under a final shard name.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
from collections.abc import Iterator, Sequence

import numpy as np
import webdataset as wds
from apache_beam.io.filesystems import FileSystems

from pipeline.packing import PackedSample
from schemas.manifest import ShardEntry
from schemas.sample import META_MEMBER, TOKENS_MEMBER

__all__ = ["ShardLimits", "sample_members", "shard_groups", "write_shard", "write_file_atomic", "TMP_SUFFIX"]

TMP_SUFFIX = ".tmp"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ShardLimits:
    max_samples: int = 10_000
    max_bytes: int = 512 * 2**20


class _HashingWriter(io.RawIOBase):
    """Forwards writes to ``sink`` while hashing and counting them."""

    def __init__(self, sink: io.IOBase) -> None:
        self.sink = sink
        self.sha256 = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.sha256.update(data)
        self.size += len(data)
        self.sink.write(data)
        return len(data)


def _npy(tokens: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, tokens, allow_pickle=False)
    return out.getvalue()


def sample_members(sample: PackedSample) -> dict[str, bytes | str]:
    """The sample as a webdataset dict: ``__key__`` plus one bytes value per member extension."""
    members: dict[str, bytes | str] = {
        "__key__": sample.meta.key,
        TOKENS_MEMBER: _npy(sample.tokens),
        META_MEMBER: sample.meta.to_json(),
    }
    for name, data in zip(sample.meta.image_members, sample.images):
        members[name] = data
    return members


def _sample_bytes(sample: PackedSample) -> int:
    return sample.tokens.nbytes + sum(len(d) for d in sample.images) + 4096


def shard_groups(samples: Sequence[PackedSample], limits: ShardLimits) -> Iterator[list[PackedSample]]:
    """Consecutive runs of samples that respect the shard limits (a single oversized sample gets its own shard)."""
    group: list[PackedSample] = []
    size = 0
    for sample in samples:
        n = _sample_bytes(sample)
        if group and (len(group) >= limits.max_samples or size + n > limits.max_bytes):
            yield group
            group, size = [], 0
        group.append(sample)
        size += n
    if group:
        yield group


def _temp_and_final(folder: str, name: str) -> tuple[str, str]:
    """Paths of a file written under a temporary name, then renamed (rename replaces in one step: POSIX, GCS copy)."""
    return FileSystems.join(folder, f".{name}{TMP_SUFFIX}"), FileSystems.join(folder, name)


def write_file_atomic(folder: str, name: str, data: bytes) -> str:
    """Write ``data`` to ``folder/name`` so no reader ever sees a partial file under that name."""
    tmp, final = _temp_and_final(folder, name)
    with FileSystems.create(tmp) as f:
        f.write(data)
    FileSystems.rename([tmp], [final])
    return final


def write_shard(stage_dir: str, name: str, samples: Sequence[PackedSample]) -> ShardEntry:
    """Write ``samples`` to ``stage_dir/name`` atomically and describe the result for the manifest."""
    tmp, final = _temp_and_final(stage_dir, name)
    with FileSystems.create(tmp) as raw:
        hashing = _HashingWriter(raw)
        with wds.TarWriter(hashing, encoder=False, mtime=0, user="longweave", group="longweave", mode=0o444) as tar:
            for sample in samples:
                tar.write(sample_members(sample))
    FileSystems.rename([tmp], [final])
    return ShardEntry(
        path=name,
        samples=len(samples),
        tokens=sum(s.meta.seq_len for s in samples),
        pad_tokens=sum(s.meta.pad_tokens for s in samples),
        images=sum(len(s.images) for s in samples),
        bytes=hashing.size,
        sha256=hashing.sha256.hexdigest(),
    )
