"""Data contract: validation errors name the record and field; records round-trip through JSON and parquet."""
from __future__ import annotations

import dataclasses
import json

import pyarrow.parquet as pq
import pytest

from schemas import (
    DEFAULT_STAGES,
    DocumentCounts,
    Document,
    ImageSpan,
    LengthBucket,
    PackedSampleMeta,
    PieceProvenance,
    SchemaError,
    Segment,
    ShardEntry,
    ShardManifest,
    StageSpec,
    documents_to_table,
    load_stage_config,
    table_to_documents,
)

SHA = "ab" * 32


def make_document(doc_id: str = "doc-1") -> Document:
    return Document(
        id=doc_id,
        source="test",
        segments=(
            Segment.of_text("Grüße, 世界 — first paragraph."),
            Segment.of_image(data=b"\x89PNG fake bytes", width=64, height=32),
            Segment.of_image(ref="images/cat.png"),
            Segment.of_text("last"),
        ),
        metadata={"url": "https://example.org/a", "n": 3},
    ).validate()


def make_meta(**changes: object) -> PackedSampleMeta:
    meta = PackedSampleMeta(
        key="8k-b0-2048-w000000-000001",
        stage="8k",
        seq_len=64,
        cu_seqlens=(0, 20, 50),
        provenance=(PieceProvenance("a", 0, 0, 20), PieceProvenance("b", 1, 100, 130)),
        image_spans=(ImageSpan(3, 6, 2, 3), ImageSpan(30, 4, 2, 2)),
        image_members=("img0000.jpg", "img0001.png"),
    )
    return dataclasses.replace(meta, **changes)


def make_manifest(**changes: object) -> ShardManifest:
    stage = DEFAULT_STAGES["8k"]
    manifest = ShardManifest(
        stage=stage,
        shards=(ShardEntry(path="8k-b0-2048-w000000-000000.tar", samples=2, tokens=2 * 8192, pad_tokens=30,
                           images=3, bytes=1234, sha256=SHA),),
        tokenizer_fingerprint=SHA, vision_fingerprint=SHA, input_fingerprint=SHA,
        documents=DocumentCounts(input=10, packed=7, dead_lettered=2, not_selected=1),
        dead_letters={"corrupt_image": 1, "empty_document": 1},
        packing={"fill_ratio": 0.998},
    )
    return dataclasses.replace(manifest, **changes)


def test_document_json_round_trip() -> None:
    doc = make_document()
    again = Document.from_json(doc.to_json())
    assert again == doc
    assert again.to_json() == doc.to_json()


def test_document_parquet_round_trip(tmp_path) -> None:
    docs = [make_document("a"), make_document("b")]
    pq.write_table(documents_to_table(docs), tmp_path / "docs.parquet")
    assert table_to_documents(pq.read_table(tmp_path / "docs.parquet")) == docs


@pytest.mark.parametrize(
    ("mutate", "field", "problem"),
    [
        (lambda d: dataclasses.replace(d, segments=()), "segments", "empty"),
        (lambda d: dataclasses.replace(d, segments=(Segment(kind="video"),)), "segments[0].kind", "must be"),
        (lambda d: dataclasses.replace(d, segments=(Segment(kind="text", text=None),)), "segments[0].text", "needs a str"),
        (lambda d: dataclasses.replace(d, segments=(Segment.of_image(),)), "segments[0].image_bytes", "bytes or a reference"),
        (lambda d: dataclasses.replace(d, segments=(Segment.of_image(ref="x.png", width=3),)), "segments[0].width",
         "go together"),
        (lambda d: dataclasses.replace(d, segments=(Segment.of_image(ref="x.png", width=0, height=4),)),
         "segments[0].width", ">= 1"),
        (lambda d: dataclasses.replace(d, source=""), "source", "non-empty"),
        (lambda d: dataclasses.replace(d, metadata={"x": object()}), "metadata", "JSON"),
    ],
    ids=["empty", "bad-kind", "text-none", "image-nothing", "width-alone", "width-zero", "no-source", "metadata"],
)
def test_document_validation_names_document_and_field(mutate, field: str, problem: str) -> None:
    with pytest.raises(SchemaError, match=problem) as info:
        mutate(make_document("doc-42")).validate()
    assert info.value.field == field
    assert "doc-42" in str(info.value)


def test_document_from_json_rejects_unknown_key_and_bad_base64() -> None:
    data = make_document("doc-7").to_dict()
    data["segments"][0]["colour"] = "red"
    with pytest.raises(SchemaError, match=r"document 'doc-7': field 'segments\[0\]\.colour'"):
        Document.from_dict(data)
    data = make_document("doc-8").to_dict()
    data["segments"][1]["image_b64"] = "not base64!!"
    with pytest.raises(SchemaError, match=r"doc-8.*image_b64.*base64"):
        Document.from_dict(data)
    with pytest.raises(SchemaError, match="not valid JSON"):
        Document.from_json(b"{broken")


def test_sample_meta_round_trip_and_accessors() -> None:
    meta = make_meta().validate()
    again = PackedSampleMeta.from_json(meta.to_json())
    assert again == meta
    assert (again.used_tokens, again.pad_tokens) == (50, 14)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"key": "8k.bad"}, "key"),
        ({"cu_seqlens": (0, 30, 20)}, "cu_seqlens[2]"),
        ({"cu_seqlens": (0, 20, 70)}, "cu_seqlens"),
        ({"provenance": (PieceProvenance("a", 0, 0, 20),)}, "provenance"),
        ({"provenance": (PieceProvenance("a", 0, 0, 19), PieceProvenance("b", 1, 100, 130))},
         "provenance[0].token_range"),
        ({"image_spans": (ImageSpan(3, 5, 2, 3), ImageSpan(30, 4, 2, 2))}, "image_spans[0]"),
        ({"image_spans": (ImageSpan(3, 6, 2, 3), ImageSpan(5, 4, 2, 2))}, "image_spans[1]"),
        ({"image_members": ("img0000.jpg", "../x.png")}, "image_members[1]"),
        ({"loss_mask": "everything"}, "loss_mask"),
    ],
    ids=["dotted-key", "decreasing-cu", "cu-past-seq", "provenance-count", "provenance-length", "grid-mismatch",
         "overlap", "member-escape", "loss-rule"],
)
def test_sample_meta_validation_names_sample_and_field(changes: dict, field: str) -> None:
    with pytest.raises(SchemaError) as info:
        make_meta(**changes).validate()
    assert info.value.field == field
    assert info.value.record.startswith("sample ")


def test_sample_meta_from_json_reports_missing_field() -> None:
    data = make_meta().to_dict()
    del data["cu_seqlens"]
    with pytest.raises(SchemaError, match=r"sample '8k-b0-2048-w000000-000001': field 'cu_seqlens': missing"):
        PackedSampleMeta.from_json(json.dumps(data))


def test_manifest_round_trip() -> None:
    manifest = make_manifest().validate()
    again = ShardManifest.from_json(manifest.to_json())
    assert again == manifest
    assert again.total_samples == 2


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"documents": DocumentCounts(input=10, packed=8, dead_lettered=2, not_selected=1)}, "documents"),
        ({"dead_letters": {"corrupt_image": 1}}, "dead_letters"),
        ({"tokenizer_fingerprint": "abc"}, "tokenizer_fingerprint"),
        ({"shards": (ShardEntry(path="../escape.tar", samples=1, tokens=8192, pad_tokens=0, images=0, bytes=1,
                                sha256=SHA),)}, "shards[0].path"),
        ({"shards": (ShardEntry(path="a.tar", samples=1, tokens=8000, pad_tokens=0, images=0, bytes=1,
                                sha256=SHA),)}, "shards[0].tokens"),
    ],
    ids=["counts-dont-reconcile", "reasons-dont-sum", "bad-fingerprint", "path-escape", "tokens-not-seq-multiple"],
)
def test_manifest_validation_names_field(changes: dict, field: str) -> None:
    with pytest.raises(SchemaError, match="manifest of stage '8k'") as info:
        make_manifest(**changes).validate()
    assert info.value.field == field


def test_default_stages_are_the_curriculum() -> None:
    assert {name: s.seq_len for name, s in DEFAULT_STAGES.items()} == {
        "8k": 8192, "64k": 65536, "256k": 262144, "1m": 1048576}
    for spec in DEFAULT_STAGES.values():
        assert StageSpec.from_dict(spec.to_dict()) == spec
        assert spec.bucket_of(0) is not None and spec.bucket_of(10**9) is not None
    assert DEFAULT_STAGES["64k"].bucket_of(8192).name == "b8192-inf"


def test_stage_spec_validation() -> None:
    with pytest.raises(SchemaError, match=r"stage 'x': field 'buckets\[1\]\.min_tokens'.*contiguous"):
        StageSpec(name="x", seq_len=1024, token_budget=1,
                  buckets=(LengthBucket(min_tokens=0, max_tokens=10), LengthBucket(min_tokens=20, max_tokens=None)))
    with pytest.raises(SchemaError, match=r"field 'buckets\[0\]\.weight'"):
        StageSpec(name="x", seq_len=1024, token_budget=1, buckets=(LengthBucket(min_tokens=0, max_tokens=None, weight=2),))
    with pytest.raises(SchemaError, match=r"field 'seq_len'"):
        StageSpec(name="x", seq_len=0, token_budget=1, buckets=(LengthBucket(min_tokens=0, max_tokens=None),))


def test_load_stage_config(tmp_path) -> None:
    path = tmp_path / "stages.yaml"
    path.write_text(
        "stages:\n"
        "  - name: 4k\n    seq_len: 4096\n    token_budget: 1000\n"
        "    buckets: [{min_tokens: 0, max_tokens: 4096, weight: 1.0}, {min_tokens: 4096, max_tokens: null, weight: 0.5}]\n"
    )
    stages = load_stage_config(path)
    assert list(stages) == ["4k"] and stages["4k"].buckets[1].weight == 0.5
    path.write_text("stages:\n  - name: 4k\n    seq_len: 4096\n    token_budget: 1\n    buckets: []\n    colour: red\n")
    with pytest.raises(SchemaError, match="colour"):
        load_stage_config(path)
