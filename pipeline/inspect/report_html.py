"""``inspect --html REPORT.html``: one self-contained page (no external file, script or font) to share a pack run.

Per-stage numbers, three matplotlib plots embedded as base64 PNG (document lengths, fill ratio per shard, images per
sample) and a few sample cards: each image of the card as a thumbnail beside the text around it in its document.
"""
from __future__ import annotations

import base64
import html
import io
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure  # the object API: no pyplot state and no display backend needed
from PIL import Image

from pipeline.inspect.reader import Sample, ShardReadError, read_samples
from pipeline.inspect.sample_view import ImagePart, Part, PiecePart, TextPart, sample_parts
from pipeline.inspect.summary import StageSummary, format_tokens
from pipeline.inspect.target import Target
from tokenization.tokenizer import TextTokenizer

__all__ = ["write_report", "render_report"]
log = logging.getLogger(__name__)

_CONTEXT_CHARS = 280
_THUMBNAIL = (224, 224)
_IMAGES_PER_CARD = 3
_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#1d2330;background:#fafbfc}
h1{font-size:22px}h2{font-size:18px;margin-top:28px}
table{border-collapse:collapse;background:#fff}td,th{border:1px solid #d6dae1;padding:4px 10px;text-align:right}
th{background:#eef1f5}td:first-child,th:first-child{text-align:left;font-weight:600}
.plots img{max-width:100%;border:1px solid #d6dae1;background:#fff;margin:6px 0}
.card{background:#fff;border:1px solid #d6dae1;border-radius:6px;padding:12px;margin:12px 0}
.card h3{font-size:15px;margin:0 0 6px}.meta{color:#5a6272;font-size:13px}
.image{display:flex;gap:14px;align-items:flex-start;margin:10px 0}
.image img{flex:none;border:1px solid #d6dae1}
.text{font-family:ui-monospace,monospace;font-size:12px;white-space:pre-wrap;word-break:break-word}
.marker{color:#8a2be2;font-weight:600}
"""


def _axes() -> tuple[Figure, Axes]:
    figure = Figure(figsize=(9, 3.6))
    return figure, figure.subplots()


def _png(figure: Figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _length_plot(summaries: list[StageSummary]) -> str:
    figure, ax = _axes()
    lengths = [n for s in summaries for n in s.document_lengths]
    if lengths:
        bins = np.logspace(np.log2(max(1, min(lengths))), np.log2(max(lengths) + 1), 40, base=2)
        for s in summaries:
            if s.document_lengths:
                ax.hist(s.document_lengths, bins=bins, histtype="step", linewidth=1.6, label=s.stage)
        ax.set_xscale("log", base=2)
        ax.legend(title="stage")
    ax.set(title="document length", xlabel="tokens per document", ylabel="documents")
    return _png(figure)


def _fill_plot(summaries: list[StageSummary]) -> str:
    figure, ax = _axes()
    position = 0
    for s in summaries:
        fills = [shard.fill_ratio for shard in s.shards]
        ax.bar(range(position, position + len(fills)), fills, label=s.stage)
        position += len(fills) + 1
    ax.set_ylim(0, 1.02)
    ax.set(title="fill ratio per shard", xlabel="shard (grouped by stage)", ylabel="non-padding tokens / capacity")
    ax.legend(title="stage")
    return _png(figure)


def _images_plot(summaries: list[StageSummary]) -> str:
    figure, ax = _axes()
    counts = [n for s in summaries for n in s.images_per_sample]
    if counts:
        bins = np.arange(0, max(counts) + 2) - 0.5
        for s in summaries:
            if s.images_per_sample:
                ax.hist(s.images_per_sample, bins=bins, histtype="step", linewidth=1.6, label=s.stage)
        ax.set_xscale("symlog", linthresh=10)  # most samples hold a few images, the longest stages hundreds
        ax.legend(title="stage")
    ax.set(title="images per sample", xlabel="images", ylabel="samples")
    return _png(figure)


def _stage_rows(summaries: list[StageSummary]) -> str:
    columns = ("stage", "seq_len", "shards", "samples", "tokens", "fill", "padding", "images", "documents", "pieces",
               "split docs", "input docs", "dead-lettered", "not selected")
    rows = ["<tr>" + "".join(f"<th>{c}</th>" for c in columns) + "</tr>"]
    for s in summaries:
        d = s.manifest_documents or {}
        cells = (s.stage, format_tokens(s.seq_len) if s.seq_len else "-", len(s.shards), s.samples, s.tokens,
                 f"{s.fill_ratio:.2%}", f"{1 - s.fill_ratio:.2%}", s.images, s.documents, s.pieces, s.split_documents,
                 d.get("input", "-"), d.get("dead_lettered", "-"), d.get("not_selected", "-"))
        rows.append("<tr>" + "".join(f"<td>{html.escape(f'{c:,}' if isinstance(c, int) else str(c))}</td>"
                                     for c in cells) + "</tr>")
    return "<table>" + "".join(rows) + "</table>"


def _dead_letter_rows(summaries: list[StageSummary]) -> str:
    reasons = sorted({r for s in summaries for r in s.dead_letters})
    if not reasons:
        return "<p>No dead letters.</p>"
    rows = ["<tr><th>reason</th>" + "".join(f"<th>{html.escape(s.stage)}</th>" for s in summaries) + "</tr>"]
    for reason in reasons:
        rows.append(f"<tr><td>{html.escape(reason)}</td>"
                    + "".join(f"<td>{s.dead_letters.get(reason, 0):,}</td>" for s in summaries) + "</tr>")
    return "<table>" + "".join(rows) + "</table>"


def _thumbnail(data: bytes) -> str | None:
    try:
        with Image.open(io.BytesIO(data)) as image:
            image = image.convert("RGB")
            image.thumbnail(_THUMBNAIL)
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=80)
    except (OSError, ValueError, Image.DecompressionBombError):
        return None
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _context(parts: list[Part], index: int, step: int) -> str:
    """Text next to ``parts[index]`` in its piece, walking ``step`` (−1 before, +1 after) up to a piece boundary."""
    out: list[str] = []
    i = index + step
    while 0 <= i < len(parts) and not isinstance(parts[i], PiecePart) and sum(map(len, out)) < _CONTEXT_CHARS:
        part = parts[i]
        out.append(part.text if isinstance(part, TextPart) else part.marker)
        i += step
    text = "".join(reversed(out) if step < 0 else out)
    return text[-_CONTEXT_CHARS:] if step < 0 else text[:_CONTEXT_CHARS]


def _card(sample: Sample, parts: list[Part]) -> str:
    meta = sample.meta
    documents = ", ".join(dict.fromkeys(p.doc_id for p in meta.provenance))
    blocks = []
    for index, part in enumerate(parts):
        if not isinstance(part, ImagePart) or len(blocks) == _IMAGES_PER_CARD:
            continue
        thumb = _thumbnail(part.data)
        image = (f'<img alt="{html.escape(part.member)}" src="data:image/jpeg;base64,{thumb}">' if thumb
                 else "<div>(image cannot be decoded)</div>")
        blocks.append(f'<div class="image">{image}<div class="text">…{html.escape(_context(parts, index, -1))}'
                      f'<span class="marker">{html.escape(part.marker)}</span>'
                      f'{html.escape(_context(parts, index, 1))}…</div></div>')
    return (f'<div class="card"><h3>{html.escape(meta.key)}</h3><div class="meta">stage {html.escape(meta.stage)} · '
            f'{meta.used_tokens:,} / {meta.seq_len:,} tokens · {len(meta.provenance)} piece(s) · '
            f'{len(meta.image_spans)} image(s) · documents: {html.escape(documents)}</div>{"".join(blocks)}</div>')


def _cards(target: Target, tokenizer: TextTokenizer, per_stage: int) -> Iterator[str]:
    """The first ``per_stage`` samples with images of each stage (unreadable samples are logged and skipped)."""
    def handler(error: ShardReadError) -> None:
        log.warning("sample cards: %s", error)

    for stage in target.stages:
        with_images = (s for s in read_samples(stage.shards, handler) if s.meta.image_spans)
        for sample in itertools.islice(with_images, per_stage):
            yield _card(sample, sample_parts(sample, tokenizer))


def render_report(target: Target, summaries: list[StageSummary], tokenizer: TextTokenizer, *,
                  cards_per_stage: int = 2) -> str:
    plots = "".join(f'<img alt="{alt}" src="data:image/png;base64,{png}">' for alt, png in (
        ("document length histogram", _length_plot(summaries)), ("fill ratio per shard", _fill_plot(summaries)),
        ("images per sample", _images_plot(summaries))))
    title = html.escape(f"longweave inspect: {target.root}")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{_CSS}</style></head><body><h1>{title}</h1>"
            f"<h2>Stages</h2>{_stage_rows(summaries)}<h2>Dead letters</h2>{_dead_letter_rows(summaries)}"
            f'<h2>Plots</h2><div class="plots">{plots}</div>'
            f'<h2>Samples</h2>{"".join(_cards(target, tokenizer, cards_per_stage))}</body></html>\n')


def write_report(path: Path, target: Target, summaries: list[StageSummary], tokenizer: TextTokenizer) -> Path:
    path.write_text(render_report(target, summaries, tokenizer), encoding="utf-8")
    log.info("wrote %s (%.1f KiB)", path, path.stat().st_size / 1024)
    return path
