"""``inspect --verify`` on real pack output and on deliberately damaged copies: each damage reported precisely."""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
from inspect_surgery import (copy_packed, keys, manifest, meta_of, read_members, refresh_manifest, rewrite,
                             sample_with, tokens_of, with_meta, with_tokens, write_manifest, write_members)

from longweave.cli import main
from pipeline.inspect.target import resolve_target
from pipeline.inspect.verify import VerifyReport, verify
from tokenization.tokenizer import load_tokenizer
from vision.geometry import DEFAULT_POLICY

TOKENIZER = load_tokenizer()


def run_verify(path: Path, **kwargs) -> VerifyReport:
    return verify(resolve_target(path), TOKENIZER, DEFAULT_POLICY, **kwargs)


def whats(report: VerifyReport) -> set[tuple[str, str, str]]:
    return {(p.file, p.where, p.what) for p in report.problems}


@pytest.fixture
def packed(packed_small: Path, tmp_path: Path) -> Path:
    return copy_packed(packed_small, tmp_path)


def first_shard(root: Path, stage: str = "8k") -> Path:
    return sorted((root / stage).glob("*.tar"))[0]


def shard_file(shard: Path) -> str:
    return f"{shard.parent.name}/{shard.name}"


def test_pack_output_verifies_clean(packed_small: Path) -> None:
    report = run_verify(packed_small)
    assert report.problems == []
    manifests = [manifest(packed_small / s) for s in ("8k", "64k")]
    assert report.shards == sum(len(m["shards"]) for m in manifests)
    assert report.samples == sum(s["samples"] for m in manifests for s in m["shards"])
    assert report.bytes == sum(p.stat().st_size for p in packed_small.glob("*/*.tar"))


def test_cli_exit_status_and_json(packed_small: Path, packed: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", str(packed_small), "--verify"]) == 0
    assert "OK" in capsys.readouterr().out
    shard = first_shard(packed)
    rewrite(shard, lambda members: members + [("../x", b"escape")])
    assert main(["inspect", str(packed), "--verify", "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert not result["ok"]
    unsafe = "member '../x': unsafe name (path separator or leading dot)"
    assert {"file": shard_file(shard), "where": "", "what": unsafe} in result["problems"]


def test_flipped_byte_in_member_data(packed: Path) -> None:
    shard = first_shard(packed)
    with tarfile.open(shard) as tar:
        info = next(m for m in tar if m.name.endswith(".tokens.npy"))
    raw = bytearray(shard.read_bytes())
    raw[info.offset_data + 128 + 18 * 4 + 3] ^= 0xFF  # the high byte of token 18 (after the 128-byte .npy header)
    shard.write_bytes(bytes(raw))
    problems = whats(run_verify(packed))
    file, key = shard_file(shard), info.name.split(".")[0]
    sha = next(p for p in problems if p[0] == file and p[2].startswith("sha256"))
    assert sha[2].endswith(f"differs from the manifest's {manifest(packed / '8k')['shards'][0]['sha256']}")
    outside = [p for p in problems if p[1] == key and "outside the vocabulary" in p[2]]
    assert len(outside) == 1 and "at position 18" in outside[0][2]
    assert len(problems) == 2


def test_flipped_byte_in_tar_header(packed: Path) -> None:
    shard = first_shard(packed)
    with tarfile.open(shard) as tar:
        info = tar.getmembers()[30]
    raw = bytearray(shard.read_bytes())
    raw[info.offset] ^= 0x01
    shard.write_bytes(bytes(raw))
    report = run_verify(packed)
    file = shard_file(shard)
    mine = [p.what for p in report.problems if p.file == file]
    assert any(w.startswith(f"invalid tar header at byte {info.offset};") for w in mine), mine
    claimed = manifest(packed / "8k")["shards"][0]["samples"]
    assert any(w.startswith("holds ") and w.endswith(f"samples; the manifest says {claimed:,}") for w in mine), mine


@pytest.mark.parametrize("cut", ["mid-member", "at-header"])
def test_truncated_tar_is_reported(packed: Path, cut: str) -> None:
    shard = first_shard(packed)
    with tarfile.open(shard) as tar:
        info = tar.getmembers()[40]
    end = info.offset_data + info.size // 2 if cut == "mid-member" else info.offset
    shard.write_bytes(shard.read_bytes()[:end])
    mine = [p.what for p in run_verify(packed).problems if p.file == shard_file(shard) and p.where == ""]
    if cut == "mid-member":
        assert any(w.startswith("corrupt or truncated tar at byte") and "unexpected end of data" in w
                   for w in mine), mine
    else:
        assert f"truncated: the archive ends at byte {end} without its end-of-archive marker" in mine
    assert any(w.startswith(f"holds {end:,} bytes") for w in mine)


def test_empty_shard_is_reported(packed: Path) -> None:
    shard = first_shard(packed)
    shard.write_bytes(b"")
    mine = [p.what for p in run_verify(packed).problems if p.file == shard_file(shard)]
    assert any(w.startswith("corrupt or truncated tar at its start") for w in mine), mine


def test_missing_image_member(packed: Path) -> None:
    shard = first_shard(packed)
    key = sample_with(shard, lambda m: len(m["image_members"]) > 0)
    rewrite(shard, lambda members: [(n, d) for n, d in members if n != f"{key}.img0000.jpg"])
    refresh_manifest(shard)
    images = manifest(packed / "8k")["shards"][0]["images"]
    assert whats(run_verify(packed)) == {
        (shard_file(shard), key, "member img0000.jpg missing (listed in meta.json)"),
        (shard_file(shard), "", f"holds {images - 1:,} images; the manifest says {images:,}"),
    }


def test_missing_meta_member(packed: Path) -> None:
    shard = first_shard(packed)
    key = keys(shard)[0]
    rewrite(shard, lambda members: [(n, d) for n, d in members if n != f"{key}.meta.json"])
    refresh_manifest(shard)
    problems = whats(run_verify(packed))
    assert (shard_file(shard), key, "member meta.json missing") in problems


def test_manifest_sample_count_wrong(packed: Path) -> None:
    data = manifest(packed / "8k")
    entry = data["shards"][0]
    entry["samples"] += 1
    write_manifest(packed / "8k", data)
    assert whats(run_verify(packed)) == {
        ("8k/manifest.json", "", f"manifest of stage '8k': field 'shards[0].tokens': {entry['tokens']} != samples "
                                 f"{entry['samples']} × seq_len 8192"),
        (f"8k/{entry['path']}", "", f"holds {entry['samples'] - 1:,} samples; the manifest says {entry['samples']:,}"),
    }


def test_manifest_document_count_wrong(packed: Path) -> None:
    data = manifest(packed / "64k")
    data["documents"]["packed"] += 1
    write_manifest(packed / "64k", data)
    packed_docs = data["documents"]["packed"]
    problems = whats(run_verify(packed))
    assert ("64k/manifest.json", "", f"documents.packed is {packed_docs:,}, the shards hold {packed_docs - 1:,} "
                                     "documents") in problems
    assert len(problems) == 2  # and the schema error: packed + dead_lettered + not_selected != input


def test_unsafe_member_name(packed: Path) -> None:
    shard = first_shard(packed, "64k")
    rewrite(shard, lambda members: members[:3] + [("../x", b"escape")] + members[3:])
    refresh_manifest(shard)
    assert whats(run_verify(packed)) == {
        (shard_file(shard), "", "member '../x': unsafe name (path separator or leading dot)")}


def test_listed_shard_missing_and_unlisted_shard(packed: Path) -> None:
    shard = first_shard(packed)
    shard.rename(shard.with_name("8k-stray.tar"))
    problems = whats(run_verify(packed))
    assert ("8k/manifest.json", "", f"lists shard {shard.name}, which does not exist") in problems
    assert ("8k/8k-stray.tar", "", "shard not listed in the manifest") in problems


def test_wrong_image_grid_in_meta(packed: Path) -> None:
    shard = first_shard(packed)
    key = sample_with(shard, lambda m: any(s[2] != s[3] for s in m["image_spans"]))

    def swap_grid(members):
        meta = meta_of(members, key)
        i = next(i for i, s in enumerate(meta["image_spans"]) if s[2] != s[3])
        start, n, h, w = meta["image_spans"][i]
        meta["image_spans"][i] = [start, n, w, h]
        swap_grid.expected = (f"img{i:04d}.jpg: a {w * 28}×{h * 28} image has a {h}×{w} grid under the vision "
                              f"policy; its span says {w}×{h}")
        return with_meta(members, key, meta)

    rewrite(shard, swap_grid)
    refresh_manifest(shard)
    assert whats(run_verify(packed)) == {(shard_file(shard), key, swap_grid.expected)}


def test_token_inside_image_span_is_not_pad(packed: Path) -> None:
    shard = first_shard(packed)
    key = sample_with(shard, lambda m: len(m["image_spans"]) > 0)
    members = read_members(shard)
    start = meta_of(members, key)["image_spans"][0][0]
    tokens = tokens_of(members, key)
    tokens[start + 1] = 100
    write_members(shard, with_tokens(members, key, tokens))
    refresh_manifest(shard)
    assert whats(run_verify(packed)) == {
        (shard_file(shard), key, f"position {start + 1}: inside an image span but not <|image_pad|>")}


def test_token_count_differs_from_seq_len(packed: Path) -> None:
    shard = first_shard(packed)
    key = keys(shard)[0]
    members = read_members(shard)
    write_members(shard, with_tokens(members, key, tokens_of(members, key)[:-1]))
    refresh_manifest(shard)
    tokens = manifest(packed / "8k")["shards"][0]["tokens"]
    assert whats(run_verify(packed)) == {
        (shard_file(shard), key, "tokens.npy holds 8191 tokens, seq_len is 8192"),
        (shard_file(shard), "", f"holds {tokens - 1:,} tokens; the manifest says {tokens:,}"),
    }


def _later_piece(meta: dict) -> int | None:
    """Position in ``meta``'s provenance of a piece after the first of its document (the only one of it here)."""
    docs = [p[0] for p in meta["provenance"]]
    return next((j for j, p in enumerate(meta["provenance"]) if p[1] > 0 and docs.count(p[0]) == 1), None)


def _split_piece_sample(root: Path) -> tuple[Path, str, dict, int]:
    """A shard, a sample of it, its meta, and the position of a later piece of a split document in that sample."""
    for shard in sorted((root / "8k").glob("*.tar")):
        members = read_members(shard)
        for key in keys(shard):
            meta = meta_of(members, key)
            j = _later_piece(meta)
            if j is not None:
                return shard, key, meta, j
    raise AssertionError("the small corpus has no split document")


def test_missing_piece_breaks_reconciliation(packed: Path) -> None:
    shard, key, meta, j = _split_piece_sample(packed)
    doc_id, index, _ = meta["provenance"][j]
    rewrite(shard, lambda members: [(n, d) for n, d in members if not n.startswith(f"{key}.")])
    refresh_manifest(shard)
    problems = [p for p in run_verify(packed).problems if p.what.startswith(f"document {doc_id!r} piece ")]
    assert len(problems) == 1, problems
    what = problems[0].what
    assert (f"piece {index + 1} follows piece {index - 1}: piece {index} is missing" in what
            or what == f"document {doc_id!r} piece {index - 1} is the last piece found but does not end with <|eos|>: "
                       "later pieces are missing"), what


def test_overlapping_piece_ranges(packed: Path) -> None:
    shard, key, meta, j = _split_piece_sample(packed)
    doc_id, index, (start, end) = meta["provenance"][j]
    meta["provenance"][j][2] = [start - 1, end - 1]
    rewrite(shard, lambda members: with_meta(members, key, meta))
    refresh_manifest(shard)
    problems = {(p.where, p.what) for p in run_verify(packed).problems}
    assert (key, f"document {doc_id!r} piece {index} starts at token {start - 1}: overlaps the previous piece "
                 f"(ends at {start})") in problems


def test_dead_letter_counts_and_packed_dead_letters(packed: Path) -> None:
    members = read_members(first_shard(packed, "64k"))
    doc_id = json.loads(next(d for n, d in members if n.endswith("meta.json")))["provenance"][0][0]
    letter = {"doc_id": doc_id, "source": "documents.jsonl", "reason": "corrupt_image", "detail": "test", "stage": ""}
    (packed / "dead_letters" / "corrupt_image.jsonl").write_text(json.dumps(letter) + "\nnot json\n")
    problems = whats(run_verify(packed))
    file = "dead_letters/corrupt_image.jsonl"
    for stage in ("8k", "64k"):
        assert (file, "", f"1 dead letters of stage {stage!r}; its manifest counts 0") in problems
        assert (file, "line 1", f"document {doc_id!r} is dead-lettered and also packed in stage {stage!r}") in problems
    assert any(p[:2] == (file, "line 2") and p[2].startswith("not a dead letter") for p in problems)
    assert len(problems) == 5


def test_single_shard_is_checked_against_its_manifest_entry(packed: Path) -> None:
    shard = first_shard(packed)
    assert run_verify(shard).problems == []
    data = manifest(packed / "8k")
    data["shards"][0]["images"] += 1
    write_manifest(packed / "8k", data)
    images = data["shards"][0]["images"]
    assert whats(run_verify(shard)) == {(shard.name, "", f"holds {images - 1:,} images; the manifest says {images:,}")}


def test_decode_images_catches_a_broken_jpeg_body(packed: Path) -> None:
    shard = first_shard(packed)
    key = sample_with(shard, lambda m: len(m["image_members"]) > 0)
    name = f"{key}.img0000.jpg"

    def break_body(members):
        data = dict(members)[name]
        third = len(data) // 3
        return [(n, data[:third] + b"\xff" * third + data[2 * third:] if n == name else d) for n, d in members]

    rewrite(shard, break_body)
    refresh_manifest(shard)
    assert run_verify(packed).problems == []  # header, end marker and size are intact
    problems = run_verify(packed, decode_images=True).problems
    assert [(p.file, p.where) for p in problems] == [(shard_file(shard), key)]
    assert problems[0].what.startswith("img0000.jpg: cannot decode image")

