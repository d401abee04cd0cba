"""Fixtures of the loader tests: small stages re-sharded from the packed small corpus, with the shard sizes a test
needs, written by the pipeline's own shard writer so the loader reads exactly the format ``longweave pack`` writes."""
from __future__ import annotations

import dataclasses
import io
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from pipeline.packing import PackedSample
from pipeline.shards import write_shard
from schemas.manifest import MANIFEST_NAME, ShardManifest
from schemas.sample import META_MEMBER, TOKENS_MEMBER, PackedSampleMeta

MakeStage = Callable[..., Path]


def read_samples(shard: str | Path) -> list[PackedSample]:
    """The samples of one shard read with plain webdataset and the schema classes, independent of the loader."""
    samples = []
    for raw in wds.WebDataset(str(shard), shardshuffle=False, empty_check=False):
        meta = PackedSampleMeta.from_json(raw[META_MEMBER])
        tokens = np.load(io.BytesIO(raw[TOKENS_MEMBER]), allow_pickle=False)
        samples.append(PackedSample(tokens=tokens, meta=meta, images=tuple(raw[m] for m in meta.image_members)))
    return samples


@pytest.fixture(scope="session")
def pool(packed_small: Path) -> list[PackedSample]:
    """Every 8k sample of the packed small corpus, in shard order."""
    manifest = ShardManifest.from_json((packed_small / "8k" / MANIFEST_NAME).read_text())
    return [s for entry in manifest.shards for s in read_samples(packed_small / "8k" / entry.path)]


@pytest.fixture(scope="session")
def light_pool(pool: list[PackedSample]) -> list[PackedSample]:
    """Samples with at most one image, so tests that read many batches stay fast; some have one image, so image
    collation is still exercised."""
    light = [s for s in pool if len(s.images) <= 1]
    assert any(s.images for s in light) and any(not s.images for s in light)
    return light


def rekeyed(sample: PackedSample, key: str) -> PackedSample:
    return dataclasses.replace(sample, meta=dataclasses.replace(sample.meta, key=key))


def write_stage(folder: Path, shards: Sequence[Sequence[PackedSample]], template: Path) -> Path:
    """Shards ``t-<i>.tar`` of the given samples plus a manifest (stage spec and fingerprints from ``template``)."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = tuple(write_shard(str(folder), f"t-{i:03d}.tar", samples) for i, samples in enumerate(shards))
    manifest = dataclasses.replace(ShardManifest.from_json(template.read_text()), shards=entries).validate()
    path = folder / MANIFEST_NAME
    path.write_text(manifest.to_json())
    return path


@pytest.fixture
def make_stage(tmp_path: Path, pool: list[PackedSample], light_pool: list[PackedSample],
               packed_small: Path) -> MakeStage:
    """``make_stage(sizes, light=True, name="stage", samples=None)``: a stage with ``sizes[i]`` samples in shard
    ``i``, drawn cyclically from ``samples`` (default: the light pool, or the whole pool with ``light=False``) and
    re-keyed ``s<shard>-<index>`` so every sample of the stage has its own key."""

    def make(sizes: Sequence[int], *, light: bool = True, name: str = "stage",
             samples: Sequence[PackedSample] | None = None) -> Path:
        source = samples if samples is not None else light_pool if light else pool
        shards, n = [], 0
        for i, size in enumerate(sizes):
            shards.append([rekeyed(source[(n + j) % len(source)], f"s{i:03d}-{j:04d}") for j in range(size)])
            n += size
        return write_stage(tmp_path / name, shards, packed_small / "8k" / MANIFEST_NAME)

    return make


def _corrupt_member(shard: Path, key: str, suffix: str) -> None:
    """Overwrite the data of member ``<key>.<suffix>`` in place with 0xFF bytes (same size, headers intact)."""
    with tarfile.open(shard) as tar:
        info = tar.getmember(f"{key}.{suffix}")
    with open(shard, "r+b") as handle:
        handle.seek(info.offset_data)
        handle.write(b"\xff" * info.size)


@pytest.fixture
def corrupt_member() -> Callable[[Path, str, str], None]:
    """``corrupt_member(shard, key, suffix)``: garble one member's bytes in place, as a bad disk or copy would."""
    return _corrupt_member

