"""Shard reading as small generator stages: open → expand tar → group by key → decode.

Each stage takes an error ``handler`` (re-raise by default); every error is a :class:`ShardReadError` naming the shard
and, where known, the sample key. A handler that returns lets the stage go on with the next member or shard.

The tar stage walks ``tarfile`` itself rather than webdataset's ``tar_file_iterator``, because an inspector must see
what a loader may quietly step over: webdataset skips non-regular members and ``__*__`` names without a word, and
``tarfile`` ends iteration *silently* at a damaged header or a cut-off archive once past the first member. Here the
bytes after the last member must be a proper end-of-archive marker, or the shard is reported. Keys are split with
webdataset's own ``base_plus_ext``, so samples group here exactly as the loader will group them.
"""
from __future__ import annotations

import dataclasses
import io
import re
import tarfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
from webdataset.tariterators import base_plus_ext

from schemas.errors import SchemaError
from schemas.sample import IMAGE_EXTENSIONS, META_MEMBER, TOKENS_MEMBER, PackedSampleMeta, validate_key

__all__ = ["ShardReadError", "Handler", "reraise", "Member", "Sample", "open_shards", "expand_tar", "group_by_key",
           "decode", "read_samples", "parse_meta", "parse_tokens", "split_member", "RawSample", "KEY", "SHARD"]

KEY, SHARD = "__key__", "__url__"  # webdataset's names for a sample's key and its source
RawSample = dict[str, str | bytes]  # __key__, __url__, and one bytes value per member suffix
_IMAGE_SUFFIX = re.compile(rf"^img\d{{4}}\.({'|'.join(IMAGE_EXTENSIONS)})$")
_BLOCK = tarfile.BLOCKSIZE
_TAIL_CHUNK = 1 << 20


class ShardReadError(Exception):
    """A shard, or one of its samples, cannot be read. ``key`` is None for a problem of the shard as a whole."""

    def __init__(self, shard: str, key: str | None, problem: str) -> None:
        self.shard = shard
        self.key = key
        self.problem = problem
        super().__init__(f"{shard}{f' [{key}]' if key else ''}: {problem}")


Handler = Callable[[ShardReadError], None]


def reraise(error: ShardReadError) -> None:
    """The default handler: the first problem stops the read."""
    raise error


@dataclasses.dataclass(frozen=True, slots=True)
class OpenShard:
    path: str
    stream: BinaryIO


@dataclasses.dataclass(frozen=True, slots=True)
class Member:
    shard: str
    name: str
    data: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """A decoded sample. ``tokens`` is None and ``images`` empty when the read did not ask for them."""

    key: str
    shard: str
    meta: PackedSampleMeta
    tokens: np.ndarray | None
    images: tuple[bytes, ...]


def split_member(name: str) -> tuple[str, str]:
    """``(key, suffix)`` of a member name, or ``ValueError`` saying why the name is not one a shard may hold."""
    if "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(f"member {name!r}: unsafe name (path separator or leading dot)")
    key, suffix = base_plus_ext(name)
    if key is None:
        raise ValueError(f"member {name!r}: not <key>.<suffix>")
    try:
        validate_key(key)
    except SchemaError:
        raise ValueError(f"member {name!r}: bad sample key {key!r} (letters, digits, _ and - only)") from None
    if suffix not in (TOKENS_MEMBER, META_MEMBER) and not _IMAGE_SUFFIX.match(suffix):
        raise ValueError(f"member {name!r}: unexpected suffix {suffix!r}")
    return key, suffix


def open_shards(paths: Iterable[str | Path], handler: Handler = reraise) -> Iterator[OpenShard]:
    for path in paths:
        try:
            yield OpenShard(str(path), open(path, "rb"))  # noqa: SIM115 - expand_tar closes it
        except OSError as exc:
            handler(ShardReadError(str(path), None, f"cannot open: {exc.strerror}"))


def _check_end_of_archive(stream: BinaryIO, offset: int) -> str | None:
    """After the last member, a tar holds zero blocks only (at least two). Otherwise say what is wrong."""
    stream.seek(offset)
    size = zeros = 0
    first = b""
    while chunk := stream.read(_TAIL_CHUNK):
        if not first:
            first = chunk[:_BLOCK]
        size += len(chunk)
        zeros += chunk.count(0)
    if first.strip(b"\0"):
        return f"invalid tar header at byte {offset}; the {size:,} bytes from there on were not read"
    if zeros != size:
        return f"data after the end-of-archive marker at byte {offset}"
    if size < 2 * _BLOCK:
        return f"truncated: the archive ends at byte {offset + size} without its end-of-archive marker"
    return None


def expand_tar(shards: Iterable[OpenShard], handler: Handler = reraise,
               select: Callable[[str], bool] | None = None) -> Iterator[Member]:
    """Regular members of each shard, in order; ``select(name)`` False skips a member without reading its data."""
    for shard in shards:
        last_key: str | None = None
        tar = None
        try:
            tar = tarfile.open(fileobj=shard.stream, mode="r:")
            for info in tar:
                last_key = info.name.partition(".")[0] or last_key
                if not info.isreg():
                    handler(ShardReadError(shard.path, last_key, f"member {info.name!r} is not a regular file"))
                    continue
                if select is not None and not select(info.name):
                    continue
                yield Member(shard.path, info.name, tar.extractfile(info).read())
            problem = _check_end_of_archive(shard.stream, tar.offset)
            if problem:
                handler(ShardReadError(shard.path, None, problem))
        except (tarfile.TarError, OSError, EOFError) as exc:
            where = f"byte {tar.offset}" if tar is not None else "its start"
            after = f" (after sample {last_key!r})" if last_key else ""
            handler(ShardReadError(shard.path, None, f"corrupt or truncated tar at {where}{after}: {exc}"))
        finally:
            shard.stream.close()


def group_by_key(members: Iterable[Member], handler: Handler = reraise) -> Iterator[RawSample]:
    """Consecutive members with the same key → one sample dict. Bad names and split samples go to the handler."""
    current: RawSample | None = None
    shard: str | None = None
    seen: set[str] = set()
    for member in members:
        if member.shard != shard:
            if current is not None:
                yield current
            current, shard, seen = None, member.shard, set()
        try:
            key, suffix = split_member(member.name)
        except ValueError as exc:
            handler(ShardReadError(member.shard, None, str(exc)))
            continue
        if current is None or current[KEY] != key:
            if current is not None:
                yield current
            current = None
            if key in seen:
                problem = f"member {member.name!r} is apart from the rest of its sample"
                handler(ShardReadError(member.shard, key, problem))
                continue
            seen.add(key)
            current = {KEY: key, SHARD: member.shard}
        if suffix in current:
            handler(ShardReadError(member.shard, key, f"member {member.name!r} appears twice"))
            continue
        current[suffix] = member.data
    if current is not None:
        yield current


def parse_meta(sample: RawSample) -> PackedSampleMeta:
    """The validated ``meta.json`` of a raw sample, whose key must match the members' key."""
    shard, key = str(sample[SHARD]), str(sample[KEY])
    raw = sample.get(META_MEMBER)
    if raw is None:
        raise ShardReadError(shard, key, f"member {META_MEMBER} missing")
    try:
        meta = PackedSampleMeta.from_json(raw)
    except SchemaError as exc:
        raise ShardReadError(shard, key, f"{META_MEMBER}: field {exc.field!r}: {exc.problem}") from None
    if meta.key != key:
        raise ShardReadError(shard, key, f"{META_MEMBER}: key {meta.key!r} differs from the member key")
    return meta


def parse_tokens(sample: RawSample) -> np.ndarray:
    """``tokens.npy`` as a 1-D uint32 array (no pickle is ever loaded)."""
    shard, key = str(sample[SHARD]), str(sample[KEY])
    raw = sample.get(TOKENS_MEMBER)
    if raw is None:
        raise ShardReadError(shard, key, f"member {TOKENS_MEMBER} missing")
    try:
        tokens = np.load(io.BytesIO(raw), allow_pickle=False)  # type: ignore[arg-type]
    except (ValueError, OSError, EOFError) as exc:
        raise ShardReadError(shard, key, f"{TOKENS_MEMBER}: not a readable .npy array ({exc})") from None
    if tokens.dtype != np.uint32 or tokens.ndim != 1:
        raise ShardReadError(shard, key, f"{TOKENS_MEMBER}: expected 1-D uint32, got {tokens.ndim}-D {tokens.dtype}")
    return tokens


def decode(samples: Iterable[RawSample], handler: Handler = reraise, *, tokens: bool = True,
           images: bool = True) -> Iterator[Sample]:
    """Raw samples → :class:`Sample`; ``tokens``/``images`` say whether those members were read and must be there."""
    for raw in samples:
        try:
            meta = parse_meta(raw)
            ids = parse_tokens(raw) if tokens else None
            missing = [m for m in meta.image_members if m not in raw] if images else []
            if missing:
                raise ShardReadError(str(raw[SHARD]), meta.key, f"member {missing[0]} missing")
        except ShardReadError as exc:
            handler(exc)
            continue
        pictures = tuple(raw[m] for m in meta.image_members) if images else ()
        yield Sample(meta.key, str(raw[SHARD]), meta, ids, pictures)  # type: ignore[arg-type]


def _selector(tokens: bool, images: bool, key: str | None) -> Callable[[str], bool] | None:
    if tokens and images and key is None:
        return None

    def select(name: str) -> bool:
        stem, _, suffix = name.partition(".")
        if key is not None and stem != key:
            return False
        return suffix == META_MEMBER or (tokens and suffix == TOKENS_MEMBER) or (images and suffix.startswith("img"))

    return select


def read_samples(paths: Iterable[str | Path], handler: Handler = reraise, *, tokens: bool = True,
                 images: bool = True, key: str | None = None) -> Iterator[Sample]:
    """Decoded samples of ``paths`` in order; members not asked for are skipped unread (the tar is seekable)."""
    members = expand_tar(open_shards(paths, handler), handler, _selector(tokens, images, key))
    return decode(group_by_key(members, handler), handler, tokens=tokens, images=images)
