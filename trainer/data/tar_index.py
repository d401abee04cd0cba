"""Random access into WebDataset tars: index the member offsets of a shard once, then read a sample by offset.

A sample's members are consecutive in the tar (the writer sorts them by key), so reading one sample is a single seek
and read of the byte range from its first member's data to its last member's end. The index comes from the tar
headers alone (``tarfile`` skips over member data), and is checked against the manifest: a shard with a different
size or number of samples than the manifest records is fatal, because every sample position after it would be wrong.
"""
from __future__ import annotations

import dataclasses
import os
import tarfile

from webdataset.tariterators import base_plus_ext

from trainer.data.errors import LoaderFatalError
from trainer.data.manifest_source import ShardSource

__all__ = ["Member", "SampleSpan", "index_shard", "ShardReader"]


@dataclasses.dataclass(frozen=True, slots=True)
class Member:
    """``suffix`` as webdataset names it (``tokens.npy``, ``img0000.jpg``): the member name after the key's dot."""

    suffix: str
    offset: int
    size: int


@dataclasses.dataclass(frozen=True, slots=True)
class SampleSpan:
    """A sample's members and the byte range ``[start, end)`` of the shard that holds all their data."""

    key: str
    members: tuple[Member, ...]

    @property
    def start(self) -> int:
        return self.members[0].offset

    @property
    def end(self) -> int:
        return self.members[-1].offset + self.members[-1].size


def _split_name(name: str) -> tuple[str, str]:
    """``key, suffix`` by webdataset's own rule (the key ends at the first dot of the base name), as inspect does."""
    key, suffix = base_plus_ext(name)
    if key is None:
        raise ValueError(f"member {name!r} has no '<key>.<suffix>' form")
    return key, suffix


def index_shard(shard: ShardSource) -> tuple[SampleSpan, ...]:
    """The samples of ``shard`` in tar order. Raises :class:`LoaderFatalError` when the shard is missing, is not a
    tar, interleaves keys, or disagrees with the manifest's size or sample count."""
    try:
        size = os.path.getsize(shard.path)
        if size != shard.bytes:
            raise LoaderFatalError(f"shard {shard.name!r}: {size} bytes on disk, manifest says {shard.bytes}")
        spans: list[SampleSpan] = []
        seen: set[str] = set()
        members: list[Member] = []
        key = None
        with tarfile.open(shard.path, mode="r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                name_key, suffix = _split_name(info.name)
                if name_key != key:
                    if key is not None:
                        spans.append(SampleSpan(key, tuple(members)))
                    if name_key in seen:
                        raise ValueError(f"key {name_key!r} appears in two separate runs of members")
                    seen.add(name_key)
                    key, members = name_key, []
                members.append(Member(suffix, info.offset_data, info.size))
        if key is not None:
            spans.append(SampleSpan(key, tuple(members)))
    except (OSError, tarfile.TarError, ValueError) as exc:
        raise LoaderFatalError(f"shard {shard.name!r}: cannot index ({exc})") from None
    if len(spans) != shard.samples:
        raise LoaderFatalError(f"shard {shard.name!r}: holds {len(spans)} samples, manifest says {shard.samples}")
    return tuple(spans)


class ShardReader:
    """Reads samples by ``(shard, index)``, indexing each shard the first time it is touched.

    Each DataLoader worker holds its own reader (created after the fork), so indexes are built in parallel and only
    for the shards a worker reads. Files are opened per read: one ``open`` costs microseconds next to decoding a
    sample, and no descriptor outlives a read however many shards a stage has.
    """

    def __init__(self, shards: tuple[ShardSource, ...]) -> None:
        self.shards = shards
        self._index: dict[int, tuple[SampleSpan, ...]] = {}

    def span(self, shard: int, index: int) -> SampleSpan:
        spans = self._index.get(shard)
        if spans is None:
            spans = self._index[shard] = index_shard(self.shards[shard])
        return spans[index]

    def read(self, shard: int, index: int) -> tuple[str, dict[str, bytes]]:
        """``key`` and ``{suffix: bytes}`` of one sample (the dict webdataset would build for it, less ``__key__``)."""
        span = self.span(shard, index)
        with open(self.shards[shard].path, "rb") as handle:
            handle.seek(span.start)
            data = handle.read(span.end - span.start)
        if len(data) != span.end - span.start:
            raise LoaderFatalError(f"shard {self.shards[shard].name!r}: truncated while reading key {span.key!r}")
        return span.key, {m.suffix: data[m.offset - span.start:m.offset - span.start + m.size] for m in span.members}
