"""Deliberate damage to copies of real shards, for the inspect tests: rewrite members, then (optionally) make the
manifest agree with the new bytes so that only the damage under test is left to report."""
from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

Members = list[tuple[str, bytes]]


def copy_packed(packed: Path, tmp_path: Path) -> Path:
    out = tmp_path / "packed"
    shutil.copytree(packed, out)
    for path in out.rglob("*"):
        if path.is_file():
            path.chmod(0o644)  # shards are written read-only
    return out


def read_members(shard: Path) -> Members:
    with tarfile.open(shard) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar]


def write_members(shard: Path, members: Members) -> None:
    with tarfile.open(shard, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def rewrite(shard: Path, change: Callable[[Members], Members]) -> None:
    write_members(shard, change(read_members(shard)))


def keys(shard: Path) -> list[str]:
    return list(dict.fromkeys(name.split(".", 1)[0] for name, _ in read_members(shard)))


def member(members: Members, name: str) -> bytes:
    return next(data for n, data in members if n == name)


def replace(members: Members, name: str, data: bytes) -> Members:
    assert any(n == name for n, _ in members), name
    return [(n, data if n == name else d) for n, d in members]


def meta_of(members: Members, key: str) -> dict:
    return json.loads(member(members, f"{key}.meta.json"))


def with_meta(members: Members, key: str, meta: dict) -> Members:
    return replace(members, f"{key}.meta.json", json.dumps(meta, sort_keys=True).encode())


def tokens_of(members: Members, key: str) -> np.ndarray:
    return np.load(io.BytesIO(member(members, f"{key}.tokens.npy")))


def with_tokens(members: Members, key: str, tokens: np.ndarray) -> Members:
    out = io.BytesIO()
    np.save(out, tokens, allow_pickle=False)
    return replace(members, f"{key}.tokens.npy", out.getvalue())


def manifest(stage_dir: Path) -> dict:
    return json.loads((stage_dir / "manifest.json").read_text())


def write_manifest(stage_dir: Path, data: dict) -> None:
    (stage_dir / "manifest.json").write_text(json.dumps(data, indent=2, sort_keys=True))


def refresh_manifest(shard: Path) -> None:
    """Make the manifest's sha256 and byte count of ``shard`` match its current bytes (nothing else changes)."""
    data = manifest(shard.parent)
    entry = next(s for s in data["shards"] if s["path"] == shard.name)
    raw = shard.read_bytes()
    entry["sha256"], entry["bytes"] = hashlib.sha256(raw).hexdigest(), len(raw)
    write_manifest(shard.parent, data)


def sample_with(shard: Path, predicate: Callable[[dict], bool]) -> str:
    """Key of the first sample of ``shard`` whose meta satisfies ``predicate``."""
    members = read_members(shard)
    return next(k for k in keys(shard) if predicate(meta_of(members, k)))
