"""``inspect --sample`` and ``--export``: one sample decoded with markers, an export that stays inside its folder."""
from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from inspect_surgery import copy_packed, keys, meta_of, read_members, rewrite
from PIL import Image

from longweave.cli import main
from pipeline.inspect.sample_view import (ImagePart, PaddingPart, PiecePart, TextPart, UnsafeExport, find_sample,
                                          parts_text, sample_parts, write_inside)
from pipeline.inspect.target import resolve_target
from tokenization.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer()


def image_sample_key(shard: Path) -> str:
    members = read_members(shard)
    return next(k for k in keys(shard) if meta_of(members, k)["image_spans"])


def shard_of(root: Path) -> Path:
    return sorted((root / "8k").glob("*.tar"))[0]


def test_index_and_key_find_the_same_sample(packed_small: Path) -> None:
    target = resolve_target(packed_small)
    third = keys(shard_of(packed_small))[3]
    assert find_sample(target, "3").key == third
    assert find_sample(target, third).meta.key == third
    with pytest.raises(LookupError, match="holds fewer than"):
        find_sample(target, "999999")
    with pytest.raises(LookupError, match="no sample with that key"):
        find_sample(target, "8k-nope")


def test_parts_follow_the_token_layout(packed_small: Path) -> None:
    shard = shard_of(packed_small)
    sample = find_sample(resolve_target(shard), image_sample_key(shard))
    parts = sample_parts(sample, TOKENIZER)
    meta = sample.meta
    pieces = [p for p in parts if isinstance(p, PiecePart)]
    assert [(p.doc_id, p.piece_index, p.doc_start, p.doc_end) for p in pieces] == \
        [(p.doc_id, p.piece_index, p.token_start, p.token_end) for p in meta.provenance]
    images = [p for p in parts if isinstance(p, ImagePart)]
    assert [(i.size, i.n_tokens) for i in images] == \
        [((s.grid_w * 28, s.grid_h * 28), s.n_tokens) for s in meta.image_spans]
    text = "".join(p.text for p in parts if isinstance(p, TextPart))
    assert "<|image_pad|>" not in text and "<|image_start|>" not in text
    assert text.count("<|bos|>") == sum(p.token_start == 0 for p in meta.provenance)
    assert [p.n_tokens for p in parts if isinstance(p, PaddingPart)] == ([meta.pad_tokens] if meta.pad_tokens else [])


def test_cli_sample_export_writes_text_meta_and_images(packed_small: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    shard = shard_of(packed_small)
    key = image_sample_key(shard)
    out = tmp_path / "export"
    assert main(["inspect", str(packed_small), "--sample", key, "--export", str(out)]) == 0
    assert key in capsys.readouterr().out
    members = dict(read_members(shard))
    meta = meta_of(list(members.items()), key)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{key}.txt", f"{key}.meta.json", *(f"{key}.{m}" for m in meta["image_members"])])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    for m in meta["image_members"]:
        assert (out / f"{key}.{m}").read_bytes() == members[f"{key}.{m}"]
    text = (out / f"{key}.txt").read_text()
    for (start, n, h, w), m in zip(meta["image_spans"], meta["image_members"]):
        width, height = Image.open(io.BytesIO(members[f"{key}.{m}"])).size
        assert f"[image {width}×{height} → {n} tokens]" in text
    assert f"── document {meta['provenance'][0][0]} · piece {meta['provenance'][0][1]}" in text


def test_export_refuses_names_and_links_that_leave_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    with pytest.raises(UnsafeExport):
        write_inside(folder, "../x", b"no")
    os.symlink(tmp_path / "victim", folder / "k.txt")
    with pytest.raises(UnsafeExport):
        write_inside(folder, "k.txt", b"no")
    assert not (tmp_path / "x").exists() and not (tmp_path / "victim").exists()
    assert write_inside(folder, "k.meta.json", b"{}").read_bytes() == b"{}"


def test_hostile_member_names_never_write_outside(packed_small: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    packed = copy_packed(packed_small, tmp_path / "copy")
    shard = shard_of(packed)
    key = image_sample_key(shard)
    other = next(k for k in keys(shard) if k != key)
    rewrite(shard, lambda members: [("../x", b"escape"), *members, (f"{key}.img0000.jpg/../../../y", b"escape")])
    out = tmp_path / "copy" / "export"
    assert main(["inspect", str(shard), "--sample", other, "--export", str(out)]) == 0
    assert main(["inspect", str(shard), "--sample", key, "--export", str(out)]) == 1
    assert "unsafe" in capsys.readouterr().out
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()
                     and "packed" not in p.relative_to(tmp_path).parts)
    assert all(w.startswith("copy/export/") for w in written), written
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_parts_text_puts_markers_inline() -> None:
    parts = [PiecePart("doc", 0, 0, 9, 0), TextPart("<|bos|>a"), ImagePart("img0000.jpg", (56, 28), 2, b""),
             TextPart("b<|eos|>"), PaddingPart(3)]
    assert parts_text(parts) == ("── document doc · piece 0 · document tokens [0, 9) at sample position 0 ──"
                                 "\n"
                                 "<|bos|>a[image 56×28 → 2 tokens]b<|eos|>[padding: 3 tokens]\n")
