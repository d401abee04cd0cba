"""The default view of ``longweave inspect``: per stage, what the shards hold (rich tables, or JSON for scripts).

Counts come from one pass over the ``meta.json`` members only (token arrays and images are skipped unread, so the pass
costs a tar-header walk), next to what the manifest claims: the manifest is the record, the shards are the truth, and
``--verify`` is where a disagreement becomes an error.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeline.inspect.reader import ShardReadError, read_samples
from pipeline.inspect.target import StageTarget, Target

__all__ = ["StageSummary", "ShardSummary", "summarize", "summarize_stage", "print_summary", "length_bucket",
           "format_tokens"]
log = logging.getLogger(__name__)


def format_tokens(n: int) -> str:
    """``8192`` → ``8K``, ``1048576`` → ``1M`` (binary multiples, as stage names use them)."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def length_bucket(length: int) -> tuple[int, int]:
    """Power-of-two bucket ``[lo, hi)`` of a document length; everything below 512 tokens shares the first."""
    if length < 512:
        return 0, 512
    lo = 1 << (length.bit_length() - 1)
    return lo, lo * 2


@dataclasses.dataclass(frozen=True, slots=True)
class ShardSummary:
    path: str
    samples: int
    used_tokens: int
    tokens: int
    images: int

    @property
    def fill_ratio(self) -> float:
        return self.used_tokens / self.tokens if self.tokens else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StageSummary:
    """One stage: numbers found in its shards, and the manifest's document counts and packing record."""

    stage: str
    seq_len: int | None
    shards: tuple[ShardSummary, ...]
    documents: int  # distinct documents found in the shards
    pieces: int
    split_documents: int
    document_lengths: tuple[int, ...]  # one per document: the end of its furthest piece
    images_per_sample: tuple[int, ...]  # one per sample
    manifest_documents: dict[str, int] | None
    dead_letters: dict[str, int]
    packing: dict[str, Any]
    read_errors: int

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def used_tokens(self) -> int:
        return sum(s.used_tokens for s in self.shards)

    @property
    def images(self) -> int:
        return sum(s.images for s in self.shards)

    @property
    def fill_ratio(self) -> float:
        return self.used_tokens / self.tokens if self.tokens else 0.0

    def length_histogram(self) -> list[tuple[int, int, int]]:
        """``(lo, hi, documents)`` for every power-of-two bucket from the shortest to the longest document."""
        counts = Counter(length_bucket(n) for n in self.document_lengths)
        if not counts:
            return []
        lo, top = min(counts)[0], max(counts)[1]
        rows = []
        while lo < top:
            bucket = length_bucket(lo)
            rows.append((*bucket, counts.get(bucket, 0)))
            lo = bucket[1]
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage, "seq_len": self.seq_len, "shards": len(self.shards), "samples": self.samples,
            "tokens": self.tokens, "used_tokens": self.used_tokens, "pad_tokens": self.tokens - self.used_tokens,
            "padding": 1.0 - self.fill_ratio if self.tokens else 0.0, "fill_ratio": self.fill_ratio,
            "images": self.images, "documents_in_shards": self.documents, "pieces": self.pieces,
            "pieces_per_document": self.pieces / self.documents if self.documents else 0.0,
            "split_documents": self.split_documents, "documents": self.manifest_documents,
            "length_histogram": [{"min_tokens": lo, "max_tokens": hi, "documents": n}
                                 for lo, hi, n in self.length_histogram()],
            "images_per_sample": dict(sorted(Counter(self.images_per_sample).items())),
            "dead_letters": self.dead_letters, "packing": self.packing, "read_errors": self.read_errors,
            "per_shard": [{**dataclasses.asdict(s), "fill_ratio": s.fill_ratio} for s in self.shards],
        }


def summarize_stage(stage: StageTarget, target: Target) -> StageSummary:
    """Scan the stage's metadata; unreadable parts are logged and counted, not fatal."""
    errors: list[ShardReadError] = []

    def handler(error: ShardReadError) -> None:
        log.warning("%s (run --verify for every problem)", error)
        errors.append(error)

    shards = []
    extent: dict[str, int] = {}
    split: set[str] = set()
    pieces = 0
    images_per_sample = []
    for path in stage.shards:
        samples = used = tokens = images = 0
        for sample in read_samples([path], handler, tokens=False, images=False):
            meta = sample.meta
            samples += 1
            used += meta.used_tokens
            tokens += meta.seq_len
            images += len(meta.image_spans)
            images_per_sample.append(len(meta.image_spans))
            pieces += len(meta.provenance)
            for piece in meta.provenance:
                extent[piece.doc_id] = max(extent.get(piece.doc_id, 0), piece.token_end)
                if piece.piece_index > 0:
                    split.add(piece.doc_id)
        shards.append(ShardSummary(target.relative(path), samples, used, tokens, images))
    manifest = stage.manifest
    return StageSummary(
        stage=stage.name,
        seq_len=stage.seq_len,
        shards=tuple(shards),
        documents=len(extent),
        pieces=pieces,
        split_documents=len(split),
        document_lengths=tuple(extent.values()),
        images_per_sample=tuple(images_per_sample),
        manifest_documents=dataclasses.asdict(manifest.documents) if manifest else None,
        dead_letters=dict(sorted(manifest.dead_letters.items())) if manifest else {},
        packing=dict(manifest.packing) if manifest else {},
        read_errors=len(errors),
    )


def summarize(target: Target) -> list[StageSummary]:
    return [summarize_stage(stage, target) for stage in target.stages]


def _stage_table(summaries: list[StageSummary]) -> Table:
    table = Table(title="stages")
    for column in ("stage", "shards", "samples", "tokens", "padding", "fill", "baseline fill", "images", "documents",
                   "pieces", "split docs", "read errors"):
        table.add_column(column, justify="right")
    for s in summaries:
        baseline = s.packing.get("baseline_concat_chunk", {}).get("fill_ratio")
        table.add_row(
            s.stage, f"{len(s.shards):,}", f"{s.samples:,}", f"{s.tokens:,}",
            f"{1 - s.fill_ratio:.2%}" if s.tokens else "-", f"{s.fill_ratio:.2%}" if s.tokens else "-",
            f"{baseline:.2%}" if baseline is not None else "-", f"{s.images:,}", f"{s.documents:,}", f"{s.pieces:,}",
            f"{s.split_documents:,}", f"[red]{s.read_errors}[/red]" if s.read_errors else "0",
        )
    return table


def _documents_table(summaries: list[StageSummary]) -> Table:
    table = Table(title="documents (manifest) and dead letters")
    for column in ("stage", "input", "packed", "dead-lettered", "not selected", "dead letters by reason"):
        table.add_column(column, justify="right")
    for s in summaries:
        d = s.manifest_documents
        reasons = ", ".join(f"{r}: {n}" for r, n in s.dead_letters.items()) or "-"
        cells = [f"{d[k]:,}" for k in ("input", "packed", "dead_lettered", "not_selected")] if d else ["-"] * 4
        table.add_row(s.stage, *cells, reasons)
    return table


def _histogram_table(summaries: list[StageSummary]) -> Table:
    table = Table(title="documents by length (tokens)")
    table.add_column("length", justify="right")
    rows: dict[tuple[int, int], dict[str, int]] = {}
    for s in summaries:
        table.add_column(s.stage, justify="right")
        for lo, hi, n in s.length_histogram():
            rows.setdefault((lo, hi), {})[s.stage] = n
    for (lo, hi), counts in sorted(rows.items()):
        table.add_row(f"{format_tokens(lo)}–{format_tokens(hi)}", *(f"{counts.get(s.stage, 0):,}" for s in summaries))
    return table


def print_summary(summaries: list[StageSummary], console: Console, root: Path) -> None:
    console.print(f"[bold]{root}[/bold]")
    for table in (_stage_table(summaries), _documents_table(summaries), _histogram_table(summaries)):
        console.print(table)
