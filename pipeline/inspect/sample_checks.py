"""The checks ``inspect --verify`` runs on one raw sample: every problem it has, not only the first.

A sample must hold exactly the members its ``meta.json`` lists; its tokens must be ``seq_len`` long and laid out as
the data contract says (each image span is ``<|image_start|>`` N × ``<|image_pad|>`` ``<|image_end|>``, padding only
after the last piece, ``<|bos|>`` exactly where a document starts); each image must have the size its grid implies
under the vision policy. What a sample says about its pieces is returned for the stage-wide reconciliation.
"""
from __future__ import annotations

import dataclasses
import io

import numpy as np
from PIL import Image

from pipeline.inspect.reader import KEY, RawSample, ShardReadError, parse_meta, parse_tokens
from schemas.sample import ImageSpan, PackedSampleMeta
from tokenization.tokenizer import SpecialIds
from vision.geometry import GeometryError, VisionPolicy, merged_grid

__all__ = ["SampleChecks", "PieceSeen", "SampleResult", "check_sample"]

_JPEG_END = b"\xff\xd9"
_PNG_END = b"IEND\xaeB`\x82"
_FORMATS = {"jpg": "JPEG", "png": "PNG"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SampleChecks:
    """What a sample is checked against. ``seq_len`` is None when no manifest says it."""

    stage: str
    seq_len: int | None
    special: SpecialIds
    vocab_size: int
    policy: VisionPolicy
    decode_images: bool = False  # decode every image fully, not only its header and its end marker


@dataclasses.dataclass(frozen=True, slots=True)
class PieceSeen:
    """One piece as found in a sample: enough to check that a document's pieces tile it exactly once."""

    doc_id: str
    piece_index: int
    start: int
    end: int
    ends_with_eos: bool | None  # None when the tokens could not be read
    key: str


@dataclasses.dataclass(frozen=True, slots=True)
class SampleResult:
    problems: tuple[str, ...]
    pieces: tuple[PieceSeen, ...]
    tokens: int
    pad_tokens: int
    images: int


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _check_tokens(tokens: np.ndarray, meta: PackedSampleMeta, checks: SampleChecks) -> list[str]:
    special, cu = checks.special, np.asarray(meta.cu_seqlens)
    used = meta.used_tokens
    problems = []
    if int(tokens.max()) >= checks.vocab_size:
        at = _first(tokens >= checks.vocab_size)
        problems.append(f"token id {int(tokens[at])} at position {at} is outside the vocabulary ({checks.vocab_size})")
    if np.any(tokens[used:] != special.pad):
        problems.append(f"position {used + _first(tokens[used:] != special.pad)} after the last piece is not <|pad|>")
    if np.any(tokens[:used] == special.pad):
        problems.append(f"<|pad|> at position {_first(tokens[:used] == special.pad)}, inside a piece")
    expected = np.zeros(len(tokens), dtype=bool)
    for i, span in enumerate(meta.image_spans):
        expected[span.start:span.start + span.n_tokens] = True
        before, after = span.start - 1, span.start + span.n_tokens
        if before < 0 or tokens[before] != special.image_start or after >= used or tokens[after] != special.image_end:
            problems.append(f"image span {i} at {span.start}: not enclosed by <|image_start|> … <|image_end|>")
        elif np.searchsorted(cu, before, "right") != np.searchsorted(cu, after, "right"):
            problems.append(f"image span {i} at {span.start}: crosses a piece boundary")
    wrong = (tokens == special.image_pad) != expected
    if np.any(wrong):
        at = _first(wrong)
        problems.append(f"position {at}: <|image_pad|> outside every image span" if not expected[at]
                        else f"position {at}: inside an image span but not <|image_pad|>")
    for name, token_id, count in (("<|image_start|>", special.image_start, len(meta.image_spans)),
                                  ("<|image_end|>", special.image_end, len(meta.image_spans))):
        found = int(np.count_nonzero(tokens[:used] == token_id))
        if found != count:
            problems.append(f"{found} {name} tokens for {count} image spans")
    firsts, lasts = tokens[cu[:-1]], tokens[cu[1:] - 1]
    for i, piece in enumerate(meta.provenance):
        if (firsts[i] == special.bos) != (piece.token_start == 0):
            state = "starts" if firsts[i] == special.bos else "does not start"
            problems.append(f"piece {i} (document {piece.doc_id!r} piece {piece.piece_index}, document tokens "
                            f"[{piece.token_start}, {piece.token_end})) {state} with <|bos|>")
    for name, token_id, expected_count in (("<|bos|>", special.bos, int(np.count_nonzero(firsts == special.bos))),
                                           ("<|eos|>", special.eos, int(np.count_nonzero(lasts == special.eos)))):
        found = int(np.count_nonzero(tokens[:used] == token_id))
        if found != expected_count:
            problems.append(f"{found} {name} tokens but {expected_count} at piece ends: one lies inside a piece")
    return problems


def _check_image(data: bytes, span: ImageSpan, member: str, checks: SampleChecks) -> list[str]:
    ext = member.rsplit(".", 1)[1]
    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt, (width, height) = image.format, image.size
            if checks.decode_images:
                image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        return [f"{member}: cannot decode image ({exc})"]
    if fmt != _FORMATS[ext]:
        return [f"{member}: holds a {fmt} image"]
    if not data.endswith(_JPEG_END if ext == "jpg" else _PNG_END):
        return [f"{member}: truncated image (no end marker)"]
    try:
        grid = merged_grid(height, width, checks.policy)
    except GeometryError as exc:
        return [f"{member}: {exc}"]
    problems = []
    if grid != (span.grid_h, span.grid_w):
        problems.append(f"{member}: a {width}×{height} image has a {grid[0]}×{grid[1]} grid under the vision policy; "
                        f"its span says {span.grid_h}×{span.grid_w}")
    unit = checks.policy.unit
    if (height, width) != (grid[0] * unit, grid[1] * unit):
        problems.append(f"{member}: stored at {width}×{height}, not resized to its {grid[0]}×{grid[1]} grid")
    return problems


def check_sample(raw: RawSample, checks: SampleChecks) -> SampleResult:
    """Every problem of one grouped sample, plus what its pieces and counts contribute to the stage totals."""
    problems: list[str] = []
    meta = tokens = None
    try:
        meta = parse_meta(raw)
    except ShardReadError as exc:
        problems.append(exc.problem)
    try:
        tokens = parse_tokens(raw)
    except ShardReadError as exc:
        problems.append(exc.problem)
    present = {s for s in raw if s.startswith("img")}
    if meta is None:
        problems += [f"member {m} cannot be matched to an image span (meta.json unreadable)" for m in sorted(present)]
        return SampleResult(tuple(problems), (), 0 if tokens is None else len(tokens), 0, len(present))
    listed = set(meta.image_members)
    problems += [f"member {m} missing (listed in meta.json)" for m in meta.image_members if m not in present]
    problems += [f"member {m} is not listed in meta.json" for m in sorted(present - listed)]
    if meta.stage != checks.stage:
        problems.append(f"meta.json: stage {meta.stage!r}, but the shard belongs to stage {checks.stage!r}")
    if checks.seq_len is not None and meta.seq_len != checks.seq_len:
        problems.append(f"meta.json: seq_len {meta.seq_len}, the stage's is {checks.seq_len}")
    ends_with_eos: list[bool | None] = [None] * len(meta.provenance)
    if tokens is not None and len(tokens) != meta.seq_len:
        problems.append(f"tokens.npy holds {len(tokens)} tokens, seq_len is {meta.seq_len}")
    elif tokens is not None:
        problems += _check_tokens(tokens, meta, checks)
        ends_with_eos = [bool(e) for e in tokens[np.asarray(meta.cu_seqlens[1:]) - 1] == checks.special.eos]
    for span, member in zip(meta.image_spans, meta.image_members):
        if member in raw:
            problems += _check_image(raw[member], span, member, checks)  # type: ignore[arg-type]
    key = str(raw[KEY])
    pieces = tuple(PieceSeen(p.doc_id, p.piece_index, p.token_start, p.token_end, eos, key)
                   for p, eos in zip(meta.provenance, ends_with_eos))
    return SampleResult(tuple(problems), pieces, 0 if tokens is None else len(tokens), meta.pad_tokens, len(present))
