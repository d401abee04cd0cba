"""The sample corpus: real photographs and prose, deterministic, both formats agree, lengths span the stages."""
from __future__ import annotations

import hashlib
import json

import pyarrow.parquet as pq
from PIL import Image

from longweave.corpus.build import CorpusConfig, build_corpus
from longweave.corpus.photos import shipped_photos
from schemas import Document

SMALL = CorpusConfig(module_packages=("skimage",), subpackage_documents=())


def _digest(folder) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def test_photos_are_real_images() -> None:
    photos = shipped_photos()
    assert len(photos) >= 20
    for photo in photos:
        with Image.open(photo.path) as im:
            im.load()
            assert min(im.size) >= 100 and photo.caption


def test_small_corpus_is_deterministic_and_formats_agree(tmp_path) -> None:
    first = build_corpus(tmp_path / "a", SMALL)
    second = build_corpus(tmp_path / "b", SMALL)
    assert first == second and _digest(tmp_path / "a") == _digest(tmp_path / "b")
    docs = [Document.from_json(line) for line in (tmp_path / "a" / "documents.jsonl").read_text().splitlines()]
    assert len(docs) == first.documents and len({d.id for d in docs}) == len(docs)
    refs = {s.image_ref for d in docs for s in d.images}
    assert refs and all((tmp_path / "a" / "images" / r).is_file() for r in refs)
    assert max(len(d.images) for d in docs) <= 10 and any(not d.images for d in docs)
    rows = pq.read_table(tmp_path / "a" / "obelics" / "part-00000.parquet").to_pylist()
    assert len(rows) == len(docs)
    for doc, row in zip(docs, rows):
        assert json.loads(row["general_metadata"])["url"] == f"sample://{doc.id}"
        assert row["texts"] == [s.text for s in doc.segments]
        assert row["images"] == [s.image_ref for s in doc.segments]
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["documents"] == len(docs) and sum(summary["histogram"].values()) == len(docs)


def test_full_corpus_spans_every_stage(full_corpus) -> None:
    """Lengths reach from ~100 tokens to far past 64K, with images, so every curriculum stage has real input."""
    _, summary = full_corpus
    assert summary.documents > 500 and summary.images > summary.documents
    assert 100 <= summary.min_tokens <= 200
    assert summary.max_tokens > 262144
    histogram = summary.histogram
    assert histogram["0-512"] > 0 and histogram["2048-8192"] > 0 and histogram["8192-65536"] > 0
    assert histogram["65536-262144"] + histogram["262144-1048576"] >= 5
