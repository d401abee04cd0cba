"""Every input format reads the same documents: JSONL, OBELICS parquet, MINT-style tars, mmc4 JSONL, HF datasets."""
from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import datasets
import pytest

from pipeline.dead_letters import DeadLetter
from pipeline.readers import read_file
from schemas import Document


def _content(doc: Document, image_root: Path) -> list[tuple[str, object]]:
    """What a document says, independent of how its images are carried (bytes or reference)."""
    return [("text", s.text) if s.kind == "text"
            else ("image", s.image_bytes if s.image_bytes is not None else (image_root / s.image_ref).read_bytes())
            for s in doc.segments]


@pytest.fixture(scope="module")
def docs(small_corpus: Path) -> list[Document]:
    all_docs = [d for d in read_file(str(small_corpus / "documents.jsonl"), "jsonl")]
    assert all(isinstance(d, Document) for d in all_docs)
    # Documents whose every image is followed by text, so mmc4 (images matched to a following sentence) holds them.
    usable = [d for d in all_docs if d.images and d.segments[-1].kind == "text" and all(
        s.kind == "text" for i, s in enumerate(d.segments[1:]) if d.segments[i].kind == "image")]
    return usable[:12]


def _key(doc_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", doc_id)


def _write_mint(docs: list[Document], root: Path, path: Path) -> None:
    with tarfile.open(path, "w") as tar:
        for doc in docs:
            texts, images, members = [], [], {}
            for seg in doc.segments:
                if seg.kind == "text":
                    texts.append(seg.text)
                    images.append(None)
                else:
                    ext = f"{len(members)}.png"
                    members[ext] = (root / seg.image_ref).read_bytes()
                    texts.append(None)
                    images.append(ext)
            members["json"] = json.dumps({"texts": texts, "images": images, "url": doc.id}).encode()
            for ext, data in sorted(members.items()):
                info = tarfile.TarInfo(f"{_key(doc.id)}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _write_mmc4(docs: list[Document], path: Path) -> None:
    with open(path, "w") as f:
        for doc in docs:
            text_list, image_info = [], []
            for seg in doc.segments:
                if seg.kind == "text":
                    text_list.append(seg.text)
                else:
                    image_info.append({"image_name": seg.image_ref, "matched_text_index": len(text_list)})
            f.write(json.dumps({"url": doc.id, "text_list": text_list, "image_info": image_info}) + "\n")


def test_obelics_matches_jsonl(small_corpus: Path, docs: list[Document]) -> None:
    by_url = {d.id: d for d in read_file(str(small_corpus / "obelics" / "part-00000.parquet"), "obelics")}
    for doc in docs:
        other = by_url[f"sample://{doc.id}"]
        assert _content(other, small_corpus / "images") == _content(doc, small_corpus / "images")


def test_mint_mmc4_and_hf_match_jsonl(small_corpus: Path, docs: list[Document], tmp_path: Path) -> None:
    root = small_corpus / "images"
    _write_mint(docs, root, tmp_path / "mint-000000.tar")
    _write_mmc4(docs, tmp_path / "mmc4.jsonl")
    rows = [{"texts": [s.text for s in d.segments], "images": [s.image_ref for s in d.segments],
             "general_metadata": json.dumps({"url": d.id}), "metadata": "[]"} for d in docs]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    expected = [_content(d, root) for d in docs]
    for fmt, path in (("mint", tmp_path / "mint-000000.tar"), ("mmc4", tmp_path / "mmc4.jsonl"), ("hf", tmp_path / "hf")):
        records = list(read_file(str(path), fmt))
        assert all(isinstance(r, Document) for r in records), (fmt, records[:1])
        assert [_content(r, root) for r in records] == expected, fmt
    assert [r.id for r in read_file(str(tmp_path / "mint-000000.tar"), "mint")] == [_key(d.id) for d in docs]


def test_malformed_records_become_dead_letters_naming_the_record(tmp_path: Path) -> None:
    (tmp_path / "bad.mmc4.jsonl").write_text(json.dumps(
        {"url": "u1", "text_list": ["a"], "image_info": [{"image_name": "x.png", "matched_text_index": 7}]}) + "\n[1, 2]\n")
    dead = list(read_file(str(tmp_path / "bad.mmc4.jsonl"), "mmc4"))
    assert [(d.doc_id, d.reason) for d in dead] == [("u1", "bad_record"), (f"{tmp_path}/bad.mmc4.jsonl:2", "bad_record")]
    assert "matched_text_index" in dead[0].detail
    with tarfile.open(tmp_path / "bad-mint.tar", "w") as tar:
        info = tarfile.TarInfo("nojson.0.png")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    (dead_mint,) = list(read_file(str(tmp_path / "bad-mint.tar"), "mint"))
    assert isinstance(dead_mint, DeadLetter) and dead_mint.doc_id == "nojson" and "no .json" in dead_mint.detail
    with pytest.raises(ValueError, match="format must be one of"):
        read_file("x", "csv")
