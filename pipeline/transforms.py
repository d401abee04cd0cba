"""The Beam graph of ``longweave pack``: one composite PTransform per stage of the job.

ReadDocuments → DropDuplicateIds → DecodeImages → Tokenize → per curriculum stage: AssignStage → Pack → WriteShards;
then WriteManifests (one per stage) and WriteDeadLetters. Every step that can reject a record has a tagged
``dead`` output; rejected records are counted with Beam ``Metrics`` and end in ``dead_letters/<reason>.jsonl``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from pipeline.dead_letters import DeadLetter
from pipeline.documents import TokenizedDocument, decode_document_images, tokenize_document
from pipeline.images import ImageCache
from pipeline.packing import concat_chunk_baseline, pack_window, stable_fraction
from pipeline.readers import read_file
from pipeline.shards import ShardLimits, shard_groups, write_file_atomic, write_shard
from schemas.document import Document
from schemas.manifest import MANIFEST_NAME, DocumentCounts, ShardEntry, ShardManifest
from schemas.stage import StageSpec
from tokenization.tokenizer import load_tokenizer
from vision.geometry import VisionPolicy

__all__ = ["ReadDocuments", "DropDuplicateIds", "DecodeImages", "Tokenize", "AssignStage", "Pack", "WriteShards",
           "WriteManifests", "WriteDeadLetters", "PackGraph", "DEAD", "MAIN"]

MAIN, DEAD = "main", "dead"
_NAMESPACE = "longweave"


def _emit(record: Any) -> Iterator[Any]:
    """Route a record: dead letters to the tagged output (counted by reason), everything else to the main one."""
    if isinstance(record, DeadLetter):
        Metrics.counter(_NAMESPACE, f"dead_letters/{record.reason}").inc()
        yield pvalue.TaggedOutput(DEAD, record)
    else:
        yield record


class _ReadFile(beam.DoFn):
    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.read = Metrics.counter(_NAMESPACE, "records_read")

    def process(self, path: str) -> Iterator[Any]:
        for index, record in enumerate(read_file(path, self.fmt)):
            self.read.inc()
            # The record's position decides which copy of a duplicated id is kept, the same on every runner.
            yield from _emit(record if isinstance(record, DeadLetter) else ((path, index), record))


class ReadDocuments(beam.PTransform):
    """Input files → ``((path, index), Document)`` (main) and unreadable records (``dead``); one file per task."""

    def __init__(self, files: list[str], fmt: str) -> None:
        super().__init__()
        self.files = files
        self.fmt = fmt

    def expand(self, pbegin: pvalue.PBegin) -> pvalue.DoOutputsTuple:
        return (
            pbegin
            | "ListFiles" >> beam.Create(self.files)
            | "SpreadFiles" >> beam.Reshuffle()
            | "ParseRecords" >> beam.ParDo(_ReadFile(self.fmt)).with_outputs(DEAD, main=MAIN)
        )


def first_position(item: tuple[str, Iterable[tuple[str, int]]]) -> Iterator[tuple[str, tuple[str, int]]]:
    """For an id read more than once: the position of the copy to keep (the first by input path and index)."""
    doc_id, positions = item
    positions = sorted(positions)
    if len(positions) > 1:
        yield doc_id, positions[0]


def keep_first_copy(item: tuple[tuple[str, int], Document], duplicated: dict[str, tuple[str, int]]) -> Iterator[Any]:
    position, doc = item
    kept = duplicated.get(doc.id)
    if kept is None or tuple(kept) == tuple(position):
        yield doc
    else:
        yield from _emit(DeadLetter(doc_id=doc.id, source=doc.source, reason="duplicate_id",
                                    detail=f"id {doc.id!r} read again at {position[0]}:{position[1]}; "
                                           f"kept the copy at {kept[0]}:{kept[1]}"))


class DropDuplicateIds(beam.PTransform):
    """Only ids and positions are shuffled; documents stay where they are and are filtered against a side input."""

    def expand(self, docs: beam.PCollection) -> pvalue.DoOutputsTuple:
        duplicated = (
            docs
            | "IdAndPosition" >> beam.Map(lambda item: (item[1].id, item[0]))
            | "GroupById" >> beam.GroupByKey()
            | "FirstPosition" >> beam.FlatMap(first_position)
        )
        return docs | "KeepFirstCopy" >> beam.FlatMap(keep_first_copy, pvalue.AsDict(duplicated)).with_outputs(
            DEAD, main=MAIN)


class _DecodeImagesFn(beam.DoFn):
    def __init__(self, image_root: str | None, policy: VisionPolicy, lossless: bool) -> None:
        self.image_root = Path(image_root) if image_root else None
        self.policy = policy
        self.lossless = lossless
        self.images = Metrics.counter(_NAMESPACE, "images_decoded")

    def setup(self) -> None:
        self.cache = ImageCache(self.policy, lossless=self.lossless)

    def process(self, doc: Document) -> Iterator[Any]:
        self.images.inc(len(doc.images))
        yield from _emit(decode_document_images(doc, self.image_root, self.cache))


class DecodeImages(beam.PTransform):
    def __init__(self, image_root: str | None, policy: VisionPolicy, lossless: bool = False) -> None:
        super().__init__()
        self.fn = _DecodeImagesFn(image_root, policy, lossless)

    def expand(self, docs: beam.PCollection) -> pvalue.DoOutputsTuple:
        return docs | "DecodeResize" >> beam.ParDo(self.fn).with_outputs(DEAD, main=MAIN)


class _TokenizeFn(beam.DoFn):
    def __init__(self, tokenizer_path: str, policy: VisionPolicy) -> None:
        self.tokenizer_path = tokenizer_path
        self.policy = policy
        self.tokens = Metrics.counter(_NAMESPACE, "tokens")

    def setup(self) -> None:
        self.tokenizer = load_tokenizer(self.tokenizer_path)

    def process(self, doc: Document) -> Iterator[Any]:
        result = tokenize_document(doc, self.tokenizer, self.policy)
        if isinstance(result, TokenizedDocument):
            self.tokens.inc(len(result))
        yield from _emit(result)


class Tokenize(beam.PTransform):
    def __init__(self, tokenizer_path: str, policy: VisionPolicy) -> None:
        super().__init__()
        self.fn = _TokenizeFn(tokenizer_path, policy)

    def expand(self, docs: beam.PCollection) -> pvalue.DoOutputsTuple:
        return docs | "EncodeLayout" >> beam.ParDo(self.fn).with_outputs(DEAD, main=MAIN)


def _select(doc: TokenizedDocument, stage: StageSpec) -> Iterator[Any]:
    """One of: ``(bucket, doc)`` when the stage takes it, a ``not_selected`` marker, or a stage dead letter."""
    longest_image = max((s.n_tokens + 2 for s in doc.image_spans), default=0)
    if longest_image > stage.seq_len:
        yield from _emit(DeadLetter(doc_id=doc.id, source=doc.source, reason="image_exceeds_seq_len",
                                    detail=f"an image of {longest_image} tokens > seq_len {stage.seq_len}",
                                    stage=stage.name))
        return
    bucket = stage.bucket_of(len(doc))
    if bucket is None or stable_fraction(stage.name, doc.id) >= bucket.weight:
        yield pvalue.TaggedOutput("not_selected", doc.id)
        return
    yield bucket.name, doc


def _window_of(item: tuple[str, TokenizedDocument], stage: StageSpec, counts: dict[str, int]):
    bucket, doc = item
    windows = max(1, math.ceil(counts[bucket] / stage.window_docs))
    return (bucket, int(stable_fraction("window", stage.name, doc.id) * windows)), doc


class AssignStage(beam.PTransform):
    """Documents → ``((bucket, window), doc)`` for one stage; windows hold about ``window_docs`` documents."""

    def __init__(self, stage: StageSpec) -> None:
        super().__init__()
        self.stage = stage

    def expand(self, docs: beam.PCollection) -> dict[str, beam.PCollection]:
        chosen = docs | "PickBucket" >> beam.FlatMap(_select, self.stage).with_outputs(DEAD, "not_selected", main=MAIN)
        counts = chosen[MAIN] | "BucketOf" >> beam.Map(lambda kv: (kv[0], 1)) | "CountPerBucket" >> beam.CombinePerKey(sum)
        windows = chosen[MAIN] | "PickWindow" >> beam.Map(_window_of, self.stage, pvalue.AsDict(counts))
        return {MAIN: windows, DEAD: chosen[DEAD], "not_selected": chosen["not_selected"]}


def _pack(item: tuple[tuple[str, int], Iterable[TokenizedDocument]], stage: StageSpec, pad_id: int):
    (bucket, window), docs = item
    docs = sorted(docs, key=lambda d: d.id)
    samples = pack_window(docs, stage=stage.name, bucket=bucket, window=window, seq_len=stage.seq_len,
                          max_images=stage.max_images_per_sample, pad_id=pad_id)
    baseline_samples, baseline_cut = concat_chunk_baseline([len(d) for d in docs], stage.seq_len)
    stats = {
        "documents": len(docs),
        "pieces": sum(len(s.meta.provenance) for s in samples),
        "split_documents": len({p.doc_id for s in samples for p in s.meta.provenance if p.piece_index > 0}),
        "baseline_samples": baseline_samples,
        "baseline_cut_documents": baseline_cut,
    }
    return (bucket, window), samples, stats


class Pack(beam.PTransform):
    """Windows of documents → packed samples (best-fit decreasing per window)."""

    def __init__(self, stage: StageSpec, pad_id: int) -> None:
        super().__init__()
        self.stage = stage
        self.pad_id = pad_id

    def expand(self, windows: beam.PCollection) -> beam.PCollection:
        return (
            windows
            | "GroupWindow" >> beam.GroupByKey()
            | "BestFitDecreasing" >> beam.Map(_pack, self.stage, self.pad_id)
        )


def _write(item, stage: StageSpec, stage_dir: str, limits: ShardLimits) -> Iterator[tuple[str, tuple]]:
    (bucket, window), samples, stats = item
    entries = []
    for index, group in enumerate(shard_groups(samples, limits)):
        name = f"{stage.name}-{bucket}-w{window:06d}-{index:06d}.tar"
        entries.append(write_shard(stage_dir, name, group))
        Metrics.counter(_NAMESPACE, f"shards/{stage.name}").inc()
    yield stage.name, ("window", [dataclasses.asdict(e) for e in entries], stats)


class WriteShards(beam.PTransform):
    def __init__(self, stage: StageSpec, stage_dir: str, limits: ShardLimits) -> None:
        super().__init__()
        self.stage, self.stage_dir, self.limits = stage, stage_dir, limits

    def expand(self, packed: beam.PCollection) -> beam.PCollection:
        return packed | "WriteTars" >> beam.FlatMap(_write, self.stage, self.stage_dir, self.limits)


class _StageReport(beam.CombineFn):
    """Per stage: shard entries, packing statistics and document counts, from the report records of the graph."""

    def create_accumulator(self) -> dict[str, Any]:
        return {"shards": [], "stats": Counter(), "counts": Counter(), "dead": Counter()}

    def add_input(self, acc: dict[str, Any], record: tuple) -> dict[str, Any]:
        kind = record[0]
        if kind == "window":
            acc["shards"].extend(record[1])
            acc["stats"].update(record[2])
        elif kind == "dead":
            acc["dead"][record[1]] += 1
        elif kind in ("packed", "not_selected"):
            acc["counts"][kind] += 1
        return acc

    def merge_accumulators(self, accs: Iterable[dict[str, Any]]) -> dict[str, Any]:
        out = self.create_accumulator()
        for acc in accs:
            out["shards"].extend(acc["shards"])
            for key in ("stats", "counts", "dead"):
                out[key].update(acc[key])
        return out

    def extract_output(self, acc: dict[str, Any]) -> dict[str, Any]:
        return {"shards": sorted(acc["shards"], key=lambda s: s["path"]), "stats": dict(acc["stats"]),
                "counts": dict(acc["counts"]), "dead": dict(acc["dead"])}


def build_manifest(stage: StageSpec, report: dict[str, Any], fingerprints: dict[str, str]) -> ShardManifest:
    shards = tuple(ShardEntry(**s) for s in report["shards"])
    stats, counts, dead = report["stats"], report["counts"], report["dead"]
    samples = sum(s.samples for s in shards)
    capacity = samples * stage.seq_len
    pad = sum(s.pad_tokens for s in shards)
    packed_docs = counts.get("packed", 0)
    dead_total = sum(dead.values())
    packing = {
        "samples": samples,
        "tokens": capacity - pad,
        "pad_tokens": pad,
        "fill_ratio": (capacity - pad) / capacity if capacity else 0.0,
        "pieces": stats.get("pieces", 0),
        "pieces_per_document": stats.get("pieces", 0) / packed_docs if packed_docs else 0.0,
        "split_documents": stats.get("split_documents", 0),
        "images": sum(s.images for s in shards),
        "baseline_concat_chunk": {
            "samples": stats.get("baseline_samples", 0),
            "cut_documents": stats.get("baseline_cut_documents", 0),
            "fill_ratio": (capacity - pad) / (stats["baseline_samples"] * stage.seq_len)
            if stats.get("baseline_samples") else 0.0,
        },
    }
    manifest = ShardManifest(
        stage=stage,
        shards=shards,
        tokenizer_fingerprint=fingerprints["tokenizer"],
        vision_fingerprint=fingerprints["vision"],
        input_fingerprint=fingerprints["input"],
        documents=DocumentCounts(input=packed_docs + counts.get("not_selected", 0) + dead_total, packed=packed_docs,
                                 dead_lettered=dead_total, not_selected=counts.get("not_selected", 0)),
        dead_letters=dead,
        packing=packing,
    )
    return manifest.validate()


def _write_manifest(item: tuple[str, dict[str, Any]], stages: dict[str, StageSpec], output: str,
                    fingerprints: dict[str, str]) -> str:
    name, report = item
    manifest = build_manifest(stages[name], report, fingerprints)
    return write_file_atomic(FileSystems.join(output, name), MANIFEST_NAME, manifest.to_json().encode("utf-8"))


class WriteManifests(beam.PTransform):
    """Combine ``(stage, report record)`` pairs into ``<stage>/manifest.json``."""

    def __init__(self, stages: dict[str, StageSpec], output: str, fingerprints: dict[str, str]) -> None:
        super().__init__()
        self.stages, self.output, self.fingerprints = stages, output, fingerprints

    def expand(self, records: beam.PCollection) -> beam.PCollection:
        return (
            records
            | "CombinePerStage" >> beam.CombinePerKey(_StageReport())
            | "WriteManifestJson" >> beam.Map(_write_manifest, self.stages, self.output, self.fingerprints)
        )


def _write_dead_letters(item: tuple[str, Iterable[str]], folder: str) -> str:
    reason, lines = item
    return write_file_atomic(folder, f"{reason}.jsonl", "".join(line + "\n" for line in sorted(lines)).encode("utf-8"))


class WriteDeadLetters(beam.PTransform):
    """``dead_letters/<reason>.jsonl``, lines sorted so reruns give the same bytes."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def expand(self, dead: beam.PCollection) -> beam.PCollection:
        return (
            dead
            | "KeyByReason" >> beam.Map(lambda d: (d.reason, d.to_json()))
            | "GroupByReason" >> beam.GroupByKey()
            | "WriteReasonFiles" >> beam.Map(_write_dead_letters, self.folder)
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PackGraph:
    """Everything the graph needs, resolved by the driver (files already matched, stages chosen)."""

    files: tuple[str, ...]
    fmt: str
    output: str
    stages: dict[str, StageSpec]
    image_root: str | None
    tokenizer_path: str
    policy: VisionPolicy
    fingerprints: dict[str, str]
    lossless_images: bool = False
    shard_limits: ShardLimits = ShardLimits()

    def build(self, pipeline: beam.Pipeline) -> None:
        read = pipeline | "ReadDocuments" >> ReadDocuments(list(self.files), self.fmt)
        unique = read[MAIN] | "DropDuplicateIds" >> DropDuplicateIds()
        decoded = unique[MAIN] | "DecodeImages" >> DecodeImages(self.image_root, self.policy, self.lossless_images)
        tokenized = decoded[MAIN] | "Tokenize" >> Tokenize(self.tokenizer_path, self.policy)
        global_dead = (read[DEAD], unique[DEAD], decoded[DEAD], tokenized[DEAD]) | "GlobalDead" >> beam.Flatten()
        pad_id = load_tokenizer(self.tokenizer_path).special.pad
        names = sorted(self.stages)
        # Report records per stage. Dead letters from before stage assignment count against every stage.
        reports = [
            pipeline | "StageMarkers" >> beam.Create([(n, ("start",)) for n in names]),
            global_dead | "DeadForEveryStage" >> beam.FlatMap(lambda d: [(n, ("dead", d.reason)) for n in names]),
        ]
        stage_dead = []
        for name in names:
            stage = self.stages[name]
            assigned = tokenized[MAIN] | f"AssignStage[{name}]" >> AssignStage(stage)
            packed = assigned[MAIN] | f"Pack[{name}]" >> Pack(stage, pad_id)
            reports += [
                packed | f"WriteShards[{name}]" >> WriteShards(stage, FileSystems.join(self.output, name),
                                                               self.shard_limits),
                assigned[MAIN] | f"PackedMarker[{name}]" >> beam.Map(lambda _, n=name: (n, ("packed",))),
                assigned["not_selected"] | f"SkipMarker[{name}]" >> beam.Map(lambda _, n=name: (n, ("not_selected",))),
                assigned[DEAD] | f"StageDead[{name}]" >> beam.Map(lambda d, n=name: (n, ("dead", d.reason))),
            ]
            stage_dead.append(assigned[DEAD])
        _ = (reports | "AllReports" >> beam.Flatten()
             | "WriteManifests" >> WriteManifests(self.stages, self.output, self.fingerprints))
        all_dead = [global_dead, *stage_dead] | "AllDead" >> beam.Flatten()
        _ = all_dead | "WriteDeadLetters" >> WriteDeadLetters(FileSystems.join(self.output, "dead_letters"))


def fingerprint_inputs(files: Iterable[str]) -> str:
    """sha256 over each input's name and content (folders: every file inside, sorted)."""
    h = hashlib.sha256()
    for name in sorted(files):
        path = Path(name)
        members = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for member in members:
            h.update(json.dumps([path.name, member.relative_to(path).as_posix() if path.is_dir() else ""]).encode())
            with open(member, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()
