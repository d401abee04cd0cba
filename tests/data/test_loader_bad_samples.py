"""Bad-sample policy: ``fail`` names shard and key; ``skip`` logs and counts, keeps batches full and ranks equal;
a run of failures past the bound, or a shard unlike its manifest, is fatal under either policy."""
from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import pytest

from trainer.data import LoaderFatalError, SampleError, build_loader


def epoch(loader: Any) -> list[dict[str, Any]]:
    return list(itertools.islice(iter(loader), loader.batches_per_epoch))


@pytest.fixture
def stage(make_stage: Any, light_pool: list) -> Path:
    with_image = next(s for s in light_pool if s.images)
    return make_stage([10, 10], samples=[with_image] + [s for s in light_pool if not s.images])


@pytest.mark.parametrize("suffix", ["tokens.npy", "meta.json", "img0000.jpg"])
def test_fail_names_shard_and_key(stage: Path, corrupt_member: Any, suffix: str) -> None:
    # s000-0000 is the stage's one sample with an image.
    key = "s001-0000" if suffix != "img0000.jpg" else "s000-0000"
    corrupt_member(stage.parent / f"t-{key[1:4]}.tar", key, suffix)
    loader = build_loader(stage, 0, 1, 2, 0, 2)  # the error crosses from a worker process intact
    with pytest.raises(SampleError, match=rf"shard 't-{key[1:4]}\.tar' key '{key}'"):
        epoch(loader)


def test_skip_counts_logs_and_keeps_ranks_equal(stage: Path, corrupt_member: Any,
                                                caplog: pytest.LogCaptureFixture) -> None:
    corrupt_member(stage.parent / "t-001.tar", "s001-0003", "tokens.npy")
    keys, skipped = [], 0
    with caplog.at_level(logging.WARNING, logger="trainer.data.loader"):
        for rank in range(2):
            loader = build_loader(stage, rank, 2, 2, 0, 2, policy="skip")
            batches = epoch(loader)
            assert len(batches) == 5 and all(len(b["sample_keys"]) == 2 for b in batches)
            keys += [k for b in batches for k in b["sample_keys"]]
            skipped += loader.skipped
            assert loader.state_dict()["skipped"] == loader.skipped
    assert skipped == 1
    assert "s001-0003" not in keys and len(keys) == 20 and len(set(keys)) == 19  # a substitute is read twice
    assert "shard 't-001.tar' key 's001-0003'" in caplog.text


def test_too_many_failures_in_a_row_are_fatal(stage: Path, corrupt_member: Any) -> None:
    corrupt_member(stage.parent / "t-000.tar", "s000-0004", "meta.json")
    loader = build_loader(stage, 0, 1, 0, 0, 2, policy="skip", max_consecutive_failures=0)
    with pytest.raises(LoaderFatalError, match="1 bad samples in a row"):
        epoch(loader)


def test_a_shard_unlike_its_manifest_is_fatal_even_under_skip(stage: Path) -> None:
    shard = stage.parent / "t-001.tar"
    shard.write_bytes(shard.read_bytes()[:-1024])
    with pytest.raises(LoaderFatalError, match=r"shard 't-001\.tar': \d+ bytes on disk, manifest says"):
        epoch(build_loader(stage, 0, 1, 0, 0, 2, policy="skip"))
