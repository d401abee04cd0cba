"""Bad input never stops the job and is never lost: each case is converted and packed, or dead-lettered with a reason."""
from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from longweave.cli import main
from longweave.corpus.docstrings import iter_module_docs
from longweave.corpus.photos import shipped_photos
from schemas import PackedSampleMeta, ShardManifest
from vision.geometry import merged_grid

PHOTO = next(p for p in shipped_photos() if p.name == "skimage-chelsea.png")  # 451×300, not square


def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    im.save(out, format=fmt, **kw)
    return out.getvalue()


def _doc(doc_id: str, *refs: str, text: str = "A short real caption about the picture that follows.") -> dict:
    segments = [{"kind": "text", "text": text}]
    segments += [{"kind": "image", "image_ref": r} for r in refs]
    return {"id": doc_id, "segments": segments}


@pytest.fixture(scope="module")
def bad_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad")
    images = root / "images"
    images.mkdir()
    photo = Image.open(PHOTO.path).convert("RGB")
    good_jpeg = _encode(photo, "JPEG", quality=90)
    good_png = _encode(photo, "PNG")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to display
    files = {
        "good.jpg": good_jpeg,
        "corrupt.jpg": good_jpeg[:4] + bytes(np.random.default_rng().integers(0, 256, 2000, dtype=np.uint8)),
        "truncated.png": good_png[: len(good_png) // 2],
        "zero.png": b"",
        "bomb.png": _encode(Image.new("1", (8000, 8000)), "PNG"),
        "cmyk.jpg": _encode(photo.convert("CMYK"), "JPEG"),
        "gray16.png": _encode(Image.fromarray(np.asarray(photo.convert("L"), dtype=np.uint16) * 257), "PNG"),
        "palette.png": _encode(photo.convert("P", palette=Image.Palette.ADAPTIVE), "PNG", transparency=0),
        "exif.jpg": _encode(photo, "JPEG", exif=exif.tobytes()),
    }
    for name, data in files.items():
        (images / name).write_bytes(data)
    prose = "".join(text for m in iter_module_docs("numpy") for _, text in m.entries)
    long_text = (prose * (4_600_000 // len(prose) + 1))[:4_600_000]  # one segment of > 1M tokens of real prose
    docs = [
        _doc("good", "good.jpg"),
        _doc("corrupt-jpeg", "corrupt.jpg"),
        _doc("truncated-png", "truncated.png"),
        _doc("zero-byte", "zero.png"),
        _doc("bomb", "bomb.png"),
        _doc("cmyk", "cmyk.jpg"),
        _doc("gray16", "gray16.png"),
        _doc("palette-alpha", "palette.png"),
        _doc("exif-rotated", "exif.jpg"),
        _doc("missing-ref", "does-not-exist.png"),
        _doc("escaping-ref", "../../etc/passwd"),
        {"id": "empty", "segments": []},
        {"id": "blank", "segments": [{"kind": "text", "text": "   \n "}]},
        _doc("dup", text="first copy"),
        _doc("dup", text="second copy"),
        _doc("very-long", text=long_text),
    ]
    lines = [json.dumps(d).encode() for d in docs]
    lines.insert(3, b'{"id": "bad-utf8", "segments": [{"kind": "text", "text": "caf\xe9 \xff"}]}')
    lines.insert(5, b'{"id": "broken-json", "segments": [')
    (root / "docs.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (root / "stages.yaml").write_text(  # both stages take every document, so every case must reach both
        "stages:\n"
        "  - {name: 8k, seq_len: 8192, token_budget: 1, buckets: [{min_tokens: 0, max_tokens: null, weight: 1.0}]}\n"
        "  - {name: 1m, seq_len: 1048576, token_budget: 1, buckets: [{min_tokens: 0, max_tokens: null, weight: 1.0}]}\n"
    )
    return root


@pytest.fixture(scope="module")
def packed_bad(bad_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed_bad")
    assert main(["pack", "--input", str(bad_corpus / "docs.jsonl"), "--format", "jsonl", "--output", str(out),
                 "--image-root", str(bad_corpus / "images"), "--config", str(bad_corpus / "stages.yaml")]) == 0
    return out


EXPECTED_DEAD = {
    "corrupt_image": {"corrupt-jpeg", "truncated-png"},
    "empty_image": {"zero-byte"},
    "decompression_bomb": {"bomb"},
    "missing_image": {"missing-ref"},
    "image_ref_escapes_root": {"escaping-ref"},
    "empty_document": {"empty", "blank"},
    "duplicate_id": {"dup"},
    "bad_json": {"docs.jsonl:6"},
    "bad_utf8": {"docs.jsonl:4"},
}
EXPECTED_PACKED = {"good", "cmyk", "gray16", "palette-alpha", "exif-rotated", "dup", "very-long"}


def _dead_letters(out: Path) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((out / "dead_letters").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            assert record["reason"] == path.stem and record["detail"]
            found.setdefault(record["reason"], set()).add(record["doc_id"].rsplit("/", 1)[-1])
    return found


def _samples(out: Path, stage: str) -> list[dict]:
    return list(wds.WebDataset(sorted(str(p) for p in (out / stage).glob("*.tar")), shardshuffle=False))


def test_each_bad_case_is_packed_or_dead_lettered_with_its_reason(packed_bad: Path) -> None:
    assert _dead_letters(packed_bad) == EXPECTED_DEAD
    for stage in ("8k", "1m"):
        manifest = ShardManifest.from_json((packed_bad / stage / "manifest.json").read_text())
        packed = {p.doc_id for s in _samples(packed_bad, stage)
                  for p in PackedSampleMeta.from_json(s["meta.json"]).provenance}
        assert packed == EXPECTED_PACKED
        counts = manifest.documents
        assert counts.input == len(EXPECTED_PACKED) + sum(len(v) for v in EXPECTED_DEAD.values())
        assert (counts.packed, counts.dead_lettered, counts.not_selected) == (7, counts.input - 7, 0)
        assert dict(manifest.dead_letters) == {k: len(v) for k, v in EXPECTED_DEAD.items()}


def test_converted_images_have_the_right_geometry(packed_bad: Path) -> None:
    grids = {}
    for sample in _samples(packed_bad, "8k"):
        meta = PackedSampleMeta.from_json(sample["meta.json"])
        for span, member in zip(meta.image_spans, meta.image_members):
            doc = next(p.doc_id for i, p in enumerate(meta.provenance)
                       if meta.cu_seqlens[i] <= span.start < meta.cu_seqlens[i + 1])
            with Image.open(io.BytesIO(sample[member])) as im:
                assert im.mode == "RGB"
                grids[doc] = (span.grid_h, span.grid_w)
    w, h = Image.open(PHOTO.path).size
    assert grids["good"] == grids["cmyk"] == grids["gray16"] == grids["palette-alpha"] == merged_grid(h, w)
    assert grids["exif-rotated"] == merged_grid(w, h)  # EXIF orientation applied: sides swapped


def test_text_segment_longer_than_a_million_tokens_is_split_not_cut(packed_bad: Path) -> None:
    for stage, seq_len in (("8k", 8192), ("1m", 1048576)):
        ranges = sorted((p.piece_index, p.token_start, p.token_end)
                        for s in _samples(packed_bad, stage)
                        for p in PackedSampleMeta.from_json(s["meta.json"]).provenance if p.doc_id == "very-long")
        assert ranges[0][1] == 0 and all(a[2] == b[1] for a, b in zip(ranges, ranges[1:]))
        assert ranges[-1][2] > 1_048_576 and all(end - start <= seq_len for _, start, end in ranges)
        assert len(ranges) >= (2 if stage == "1m" else 128)
