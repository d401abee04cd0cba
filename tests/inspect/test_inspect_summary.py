"""The default ``inspect`` summary: the numbers found in the shards agree with what ``pack`` recorded."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from inspect_surgery import copy_packed, manifest

from longweave.cli import main
from pipeline.inspect.summary import format_tokens, length_bucket, summarize
from pipeline.inspect.target import resolve_target


@pytest.mark.parametrize("stage", ["8k", "64k"])
def test_summary_agrees_with_the_manifest(packed_small: Path, stage: str) -> None:
    [summary] = summarize(resolve_target(packed_small / stage))
    m = manifest(packed_small / stage)
    assert summary.samples == m["packing"]["samples"]
    assert summary.tokens - summary.used_tokens == m["packing"]["pad_tokens"]
    assert summary.fill_ratio == pytest.approx(m["packing"]["fill_ratio"])
    assert summary.images == m["packing"]["images"]
    assert summary.documents == m["documents"]["packed"]
    assert summary.pieces == m["packing"]["pieces"]
    assert summary.split_documents == m["packing"]["split_documents"]
    assert [(s.path.split("/")[-1], s.samples, s.images) for s in summary.shards] == \
        [(s["path"], s["samples"], s["images"]) for s in m["shards"]]
    assert sum(n for _, _, n in summary.length_histogram()) == summary.documents
    assert sum(summary.to_dict()["images_per_sample"].values()) == summary.samples
    assert summary.read_errors == 0


def test_cli_summary_tables_and_json(packed_small: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", str(packed_small)]) == 0
    out = capsys.readouterr().out
    assert "stages" in out and "documents by length" in out and " 64k " in out
    assert main(["inspect", str(packed_small), "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)
    assert [s["stage"] for s in stages] == ["8k", "64k"]
    assert [s["samples"] for s in stages] == [manifest(packed_small / n)["packing"]["samples"] for n in ("8k", "64k")]


def test_summary_of_a_damaged_shard_counts_read_errors(packed_small: Path, tmp_path: Path) -> None:
    packed = copy_packed(packed_small, tmp_path)
    shard = sorted((packed / "8k").glob("*.tar"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    [summary] = summarize(resolve_target(packed / "8k"))
    assert summary.read_errors == 1
    assert 0 < summary.shards[0].samples < manifest(packed / "8k")["shards"][0]["samples"]


def test_bad_path_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert main(["inspect", str(tmp_path)]) == 2
    assert "no stage folder" in capsys.readouterr().out


def test_buckets_and_labels() -> None:
    assert [length_bucket(n) for n in (0, 511, 512, 1023, 1024, 8191)] == \
        [(0, 512), (0, 512), (512, 1024), (512, 1024), (1024, 2048), (4096, 8192)]
    assert [format_tokens(n) for n in (512, 8192, 65536, 1048576, 1000)] == ["512", "8K", "64K", "1M", "1000"]
