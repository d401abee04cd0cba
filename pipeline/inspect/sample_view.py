"""``inspect --sample KEY|INDEX``: one sample as a reader would see it, and ``--export DIR`` of its text and images.

The tokens are detokenized piece by piece; each image span becomes a marker like ``[image 336×448 → 192 tokens]``
(width × height of the stored image), each piece opens with its document id and token range, and the padding is one
marker. The same parts feed the HTML report's sample cards.

Export writes only names it builds itself from the validated sample key and the validated image member names, and
checks each resolved path against DIR (no symlink followed), so no member name can place a file outside DIR.
"""
from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path

from PIL import Image
from rich.console import Console
from rich.table import Table
from rich.text import Text

from pipeline.inspect.reader import Sample, ShardReadError, read_samples, reraise, split_member
from pipeline.inspect.target import Target
from tokenization.tokenizer import TextTokenizer

__all__ = ["TextPart", "ImagePart", "PiecePart", "PaddingPart", "Part", "find_sample", "sample_parts",
           "parts_text", "print_sample", "export_sample", "write_inside", "UnsafeExport"]


@dataclasses.dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class ImagePart:
    member: str
    size: tuple[int, int] | None  # (width, height) of the stored image; None when it cannot be decoded
    n_tokens: int
    data: bytes

    @property
    def marker(self) -> str:
        size = f"{self.size[0]}×{self.size[1]}" if self.size else "(undecodable)"
        return f"[image {size} → {self.n_tokens} tokens]"


@dataclasses.dataclass(frozen=True, slots=True)
class PiecePart:
    """The start of a document piece: where it sits in the sample and where it came from in its document."""

    doc_id: str
    piece_index: int
    doc_start: int
    doc_end: int
    sample_start: int

    @property
    def marker(self) -> str:
        return (f"── document {self.doc_id} · piece {self.piece_index} · document tokens [{self.doc_start}, "
                f"{self.doc_end}) at sample position {self.sample_start} ──")


@dataclasses.dataclass(frozen=True, slots=True)
class PaddingPart:
    n_tokens: int

    @property
    def marker(self) -> str:
        return f"[padding: {self.n_tokens:,} tokens]"


Part = TextPart | ImagePart | PiecePart | PaddingPart


def find_sample(target: Target, which: str) -> Sample:
    """The sample with key ``which``, or the ``which``-th one (from 0, in stage, shard and tar order)."""
    paths = [p for stage in target.stages for p in stage.shards]
    if which.isdigit():
        index = int(which)
        for i, found in enumerate(read_samples(paths, tokens=False, images=False)):
            if i == index:
                which = found.key
                paths = [Path(found.shard)]
                break
        else:
            raise LookupError(f"--sample {index}: {target.root} holds fewer than {index + 1} samples")
    for sample in read_samples(paths, reraise, key=which):
        return sample
    raise LookupError(f"--sample {which}: no sample with that key under {target.root}")


def _image_size(data: bytes) -> tuple[int, int] | None:
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except (OSError, ValueError, Image.DecompressionBombError):
        return None


def sample_parts(sample: Sample, tokenizer: TextTokenizer) -> list[Part]:
    """The sample in reading order: piece headers, text runs, image markers, then the padding."""
    assert sample.tokens is not None, "sample_parts needs a sample read with its tokens"
    meta, tokens = sample.meta, sample.tokens
    parts: list[Part] = []
    spans = list(zip(meta.image_spans, meta.image_members, sample.images))
    for i, piece in enumerate(meta.provenance):
        start, end = meta.cu_seqlens[i], meta.cu_seqlens[i + 1]
        parts.append(PiecePart(piece.doc_id, piece.piece_index, piece.token_start, piece.token_end, start))
        position = start
        for span, member, data in spans:
            if not start <= span.start < end:
                continue
            if span.start - 1 > position:
                parts.append(TextPart(tokenizer.decode(tokens[position:span.start - 1])))
            parts.append(ImagePart(member, _image_size(data), span.n_tokens, data))
            position = span.start + span.n_tokens + 1
        if end > position:
            parts.append(TextPart(tokenizer.decode(tokens[position:end])))
    if meta.pad_tokens:
        parts.append(PaddingPart(meta.pad_tokens))
    return parts


def parts_text(parts: list[Part]) -> str:
    """Plain text of the parts, markers inline: what ``--export`` writes as ``<key>.txt``."""
    out = []
    for part in parts:
        if isinstance(part, TextPart):
            out.append(part.text)
        elif isinstance(part, PiecePart):
            out.append(f"\n{part.marker}\n")
        else:
            out.append(part.marker)
    return "".join(out).lstrip("\n") + "\n"


def print_sample(sample: Sample, parts: list[Part], console: Console) -> None:
    meta = sample.meta
    head = Table(title=f"sample {meta.key}", show_header=False)
    for name, value in (("shard", sample.shard), ("stage", meta.stage), ("seq_len", f"{meta.seq_len:,}"),
                        ("tokens used", f"{meta.used_tokens:,} ({meta.used_tokens / meta.seq_len:.2%})"),
                        ("padding", f"{meta.pad_tokens:,}"), ("pieces", str(len(meta.provenance))),
                        ("images", str(len(meta.image_spans))), ("loss mask", meta.loss_mask)):
        head.add_row(name, Text(value))
    console.print(head)
    provenance = Table(title="provenance")
    for column in ("#", "document", "piece", "document tokens", "sample tokens"):
        provenance.add_column(column, justify="right" if column != "document" else "left")
    for i, p in enumerate(meta.provenance):
        provenance.add_row(str(i), Text(p.doc_id), str(p.piece_index), f"[{p.token_start}, {p.token_end})",
                           f"[{meta.cu_seqlens[i]}, {meta.cu_seqlens[i + 1]})")
    console.print(provenance)
    text = Text()
    for part in parts:
        if isinstance(part, TextPart):
            text.append(part.text)
        elif isinstance(part, PiecePart):
            text.append(f"\n{part.marker}\n", style="bold cyan")
        else:
            text.append(part.marker, style="bold magenta" if isinstance(part, ImagePart) else "dim")
    console.print(text)


class UnsafeExport(ValueError):
    """An export path would leave the export folder."""


def write_inside(folder: Path, name: str, data: bytes) -> Path:
    """Write ``folder/name``, refusing any name that resolves outside ``folder`` or through a symlink."""
    path = folder / name
    if path.parent.resolve() != folder.resolve() or not path.resolve().is_relative_to(folder.resolve()):
        raise UnsafeExport(f"refusing to write {name!r}: outside {folder}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def export_sample(sample: Sample, parts: list[Part], folder: Path) -> list[Path]:
    """``<key>.txt``, ``<key>.meta.json`` and ``<key>.img0000.jpg``… under ``folder``; returns the written paths."""
    folder.mkdir(parents=True, exist_ok=True)
    key = sample.meta.key
    written = [write_inside(folder, f"{key}.txt", parts_text(parts).encode("utf-8")),
               write_inside(folder, f"{key}.meta.json", sample.meta.to_json())]
    for member, data in zip(sample.meta.image_members, sample.images):
        name = f"{key}.{member}"
        try:
            split_member(name)  # the same name rule the reader enforces on shard members
        except ValueError as exc:
            raise ShardReadError(sample.shard, key, f"not exported: {exc}") from None
        written.append(write_inside(folder, name, data))
    return written
