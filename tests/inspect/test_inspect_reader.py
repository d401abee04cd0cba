"""The shard reader stages on real shards: grouping, selective reads, and errors that name the shard and key."""
from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
from inspect_surgery import copy_packed, keys, manifest, meta_of, read_members, rewrite, with_meta, write_members

from pipeline.inspect.reader import OpenShard, ShardReadError, expand_tar, open_shards, read_samples, split_member


class CountingFile(io.FileIO):
    """A file that counts the bytes read from it, to show which members a read skipped."""

    read_bytes = 0

    def read(self, size: int = -1) -> bytes:
        data = super().read(size)
        self.read_bytes += len(data)
        return data


@pytest.fixture
def packed(packed_small: Path, tmp_path: Path) -> Path:
    return copy_packed(packed_small, tmp_path)


def shard_of(root: Path, stage: str = "8k") -> Path:
    return sorted((root / stage).glob("*.tar"))[0]


def collect() -> tuple[list[ShardReadError], Callable[[ShardReadError], None]]:
    errors: list[ShardReadError] = []
    return errors, errors.append


def test_samples_match_the_manifest(packed_small: Path) -> None:
    shard = shard_of(packed_small)
    entry = manifest(packed_small / "8k")["shards"][0]
    samples = list(read_samples([shard]))
    assert len(samples) == entry["samples"] == len({s.key for s in samples})
    assert all(s.shard == str(shard) and s.meta.key == s.key for s in samples)
    assert sum(len(s.tokens) for s in samples) == entry["tokens"]
    assert sum(len(s.images) for s in samples) == entry["images"]
    assert all(len(s.images) == len(s.meta.image_spans) for s in samples)


def test_metadata_only_read_skips_token_and_image_data(packed_small: Path) -> None:
    shard = shard_of(packed_small)
    stream = CountingFile(shard)
    members = list(expand_tar([OpenShard(str(shard), stream)], select=lambda name: name.endswith(".meta.json")))
    assert {m.name.split(".", 1)[1] for m in members} == {"meta.json"}
    assert stream.read_bytes < shard.stat().st_size / 10
    light = list(read_samples([shard], tokens=False, images=False))
    assert [s.key for s in light] == keys(shard)
    assert all(s.tokens is None and s.images == () for s in light)


def test_key_selection_reads_one_sample(packed_small: Path) -> None:
    shard = shard_of(packed_small)
    key = keys(shard)[5]
    [sample] = read_samples([shard], key=key)
    assert sample.key == key and sample.tokens is not None


def test_default_handler_reraises_with_shard(packed: Path) -> None:
    shard = shard_of(packed)
    shard.write_bytes(shard.read_bytes()[:100_000])
    with pytest.raises(ShardReadError, match="corrupt or truncated tar") as caught:
        list(read_samples([shard]))
    assert caught.value.shard == str(shard)


def test_missing_shard_goes_to_the_handler(tmp_path: Path) -> None:
    errors, handler = collect()
    assert list(open_shards([tmp_path / "nope.tar"], handler)) == []
    assert [(e.shard, e.key) for e in errors] == [(str(tmp_path / "nope.tar"), None)]
    assert "cannot open" in errors[0].problem


def test_collecting_handler_goes_on_after_bad_members(packed: Path) -> None:
    shard = shard_of(packed)
    before = keys(shard)
    first, second = before[:2]

    def damage(members):
        moved = next(m for m in members if m[0] == f"{first}.tokens.npy")
        rest = [m for m in members if m is not moved]
        at = max(i for i, (n, _) in enumerate(rest) if n.startswith(f"{second}.")) + 1
        return rest[:at] + [moved, ("../x", b"escape"), (f"{second}.notes.txt", b"?")] + rest[at:]

    rewrite(shard, damage)
    errors, handler = collect()
    samples = list(read_samples([shard], handler))
    problems = {(e.key, e.problem) for e in errors}
    assert (first, f"member '{first}.tokens.npy' is apart from the rest of its sample") in problems
    assert (None, "member '../x': unsafe name (path separator or leading dot)") in problems
    assert (None, f"member '{second}.notes.txt': unexpected suffix 'notes.txt'") in problems
    assert (first, "member tokens.npy missing") in problems  # decode found the sample without its tokens
    assert [s.key for s in samples] == before[1:]


def test_non_regular_and_duplicate_members(packed: Path) -> None:
    shard = shard_of(packed)
    key = keys(shard)[0]
    members = read_members(shard)
    write_members(shard, members[:1] + [members[0]] + members[1:])
    with tarfile.open(shard, "a") as tar:
        link = tarfile.TarInfo(f"{key}.img0009.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    errors, handler = collect()
    list(read_samples([shard], handler))
    problems = {(e.key, e.problem) for e in errors}
    assert (key, f"member {members[0][0]!r} appears twice") in problems
    assert (key, f"member '{key}.img0009.jpg' is not a regular file") in problems


def test_meta_key_must_match_member_key(packed: Path) -> None:
    shard = shard_of(packed)
    key = keys(shard)[0]
    rewrite(shard, lambda members: with_meta(members, key, {**meta_of(members, key), "key": "someone-else"}))
    errors, handler = collect()
    list(read_samples([shard], handler))
    assert [(e.key, e.problem) for e in errors] == [(key, "meta.json: key 'someone-else' differs from the member key")]


@pytest.mark.parametrize("name", ["../x.meta.json", "a/b.meta.json", ".hidden.meta.json", "a.b.meta.json",
                                  "k.img12.jpg", "k.img0001.gif", "noext"])
def test_split_member_rejects(name: str) -> None:
    with pytest.raises(ValueError, match="member"):
        split_member(name)


def test_split_member_accepts_contract_names() -> None:
    assert split_member("8k-b0-inf-w000000-000001.img0003.png") == ("8k-b0-inf-w000000-000001", "img0003.png")
    assert split_member("k.tokens.npy") == ("k", "tokens.npy")
