"""No loss, no truncation, no split image: every packed document comes back token for token from the shards."""
from __future__ import annotations

import io
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from pipeline.documents import decode_document_images, tokenize_document
from pipeline.images import ImageCache
from schemas import Document, PackedSampleMeta, ShardManifest
from tokenization import load_tokenizer
from vision.geometry import DEFAULT_POLICY


def read_samples(stage_dir: Path) -> list[dict]:
    urls = sorted(str(p) for p in stage_dir.glob("*.tar"))
    return list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))


@pytest.fixture(scope="module")
def source_tokens(small_corpus: Path) -> dict[str, np.ndarray]:
    tokenizer = load_tokenizer()
    cache = ImageCache(DEFAULT_POLICY)
    out = {}
    for line in (small_corpus / "documents.jsonl").read_text().splitlines():
        doc = decode_document_images(Document.from_json(line), small_corpus / "images", cache)
        out[doc.id] = tokenize_document(doc, tokenizer, DEFAULT_POLICY).ids
    return out


@pytest.mark.parametrize("stage", ["8k", "64k"])
def test_every_packed_document_round_trips(packed_small: Path, source_tokens: dict[str, np.ndarray], stage: str) -> None:
    special = load_tokenizer().special
    manifest = ShardManifest.from_json((packed_small / stage / "manifest.json").read_text())
    samples = read_samples(packed_small / stage)
    assert len(samples) == manifest.total_samples > 0
    pieces: dict[str, list[tuple[int, int, int, np.ndarray]]] = defaultdict(list)
    non_pad = 0
    for sample in samples:
        meta = PackedSampleMeta.from_json(sample["meta.json"])
        tokens = np.load(io.BytesIO(sample["tokens.npy"]), allow_pickle=False)
        assert tokens.dtype == np.uint32 and tokens.shape == (meta.seq_len,) == (manifest.stage.seq_len,)
        assert (tokens[meta.used_tokens:] == special.pad).all()
        non_pad += meta.used_tokens
        cu = meta.cu_seqlens
        for i, prov in enumerate(meta.provenance):
            pieces[prov.doc_id].append((prov.piece_index, prov.token_start, prov.token_end, tokens[cu[i]:cu[i + 1]]))
        for span, member in zip(meta.image_spans, meta.image_members):
            assert tokens[span.start - 1] == special.image_start
            assert (tokens[span.start:span.start + span.n_tokens] == special.image_pad).all()
            assert tokens[span.start + span.n_tokens] == special.image_end
            piece = next(i for i in range(len(cu) - 1) if cu[i] <= span.start < cu[i + 1])
            assert span.start - 1 >= cu[piece] and span.start + span.n_tokens < cu[piece + 1], "image split"
            with Image.open(io.BytesIO(sample[member])) as im:
                assert im.size == (span.grid_w * DEFAULT_POLICY.unit, span.grid_h * DEFAULT_POLICY.unit)
    assert manifest.documents.packed == len(pieces)
    assert manifest.documents.input == len(source_tokens)
    for doc_id, parts in pieces.items():
        parts.sort()
        assert [p[0] for p in parts] == list(range(len(parts)))
        assert parts[0][1] == 0 and all(a[2] == b[1] for a, b in zip(parts, parts[1:]))
        rebuilt = np.concatenate([p[3] for p in parts])
        assert np.array_equal(rebuilt, source_tokens[doc_id]), doc_id
    assert non_pad == sum(len(source_tokens[d]) for d in pieces)
    assert non_pad == manifest.packing["tokens"]


def test_plain_webdataset_reads_every_shard(packed_small: Path) -> None:
    for stage in ("8k", "64k"):
        manifest = ShardManifest.from_json((packed_small / stage / "manifest.json").read_text())
        for shard in manifest.shards:
            ds = wds.WebDataset(str(packed_small / stage / shard.path), shardshuffle=False).decode("pil")
            seen = 0
            for sample in ds:
                meta = sample["meta.json"]
                assert set(sample) - {"__key__", "__url__", "__local_path__"} == {
                    "tokens.npy", "meta.json", *meta["image_members"]}
                assert sample["tokens.npy"].shape == (manifest.stage.seq_len,)
                for member in meta["image_members"]:
                    assert isinstance(sample[member], Image.Image)
                seen += 1
            assert seen == shard.samples


def test_run_json_records_config_and_counts(packed_small: Path) -> None:
    run = json.loads((packed_small / "run.json").read_text())
    assert set(run["counts"]) == {"8k", "64k"}
    assert run["config"]["runner"] == "FnApiRunner"
    assert run["metrics"]["records_read"] == run["counts"]["8k"]["input"]
    assert run["timings"]["wall_seconds"] > 0
