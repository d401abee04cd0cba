"""Readers for the five input formats. Each turns one input file into ``Document`` or ``DeadLetter`` records.

Readers are plain generators over a file path so unit tests call them directly and Beam runs one file per task. A
record that cannot be read is never dropped: it becomes a dead letter naming the file and the line, row or key.

- ``jsonl``: one ``schemas.Document`` per line (``id``, ``segments``, optional ``source`` and ``metadata``).
- ``obelics``: parquet with parallel ``texts``/``images`` lists (an image entry is a reference string or an
  ``{bytes, path}`` struct), ``metadata`` and ``general_metadata`` JSON strings; the id is ``general_metadata.id``,
  else its ``url``, else ``<file>:<row>``.
- ``mint``: MINT-1T-style WebDataset tars: ``<key>.json`` with parallel ``texts``/``images`` lists, each image entry
  the extension of a member of the same sample (``0.jpg`` for ``<key>.0.jpg``) or a reference; the id is the key.
- ``mmc4``: JSONL with ``text_list`` and ``image_info`` (``image_name``, ``matched_text_index``); each image goes
  before the sentence it is matched to; the id is ``id``, else ``url``, else ``<file>:<line>``.
- ``hf``: a local Hugging Face ``datasets`` folder (``save_to_disk``) whose rows are in the jsonl or obelics layout.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from schemas.document import Document, Segment
from schemas.errors import SchemaError, parse_json
from pipeline.dead_letters import DeadLetter

__all__ = ["FORMATS", "Record", "read_file"]

Record = Document | DeadLetter


def _dead(doc_id: str, source: str, reason: str, detail: str) -> DeadLetter:
    return DeadLetter(doc_id=doc_id, source=source, reason=reason, detail=detail)


def _is_empty(doc: Document) -> bool:
    return not doc.images and not any((s.text or "").strip() for s in doc.segments)


def _checked(doc: Document, source: str) -> Record:
    """Validate a built document; empty ones and contract breaks become dead letters."""
    try:
        doc.validate()
    except SchemaError as exc:
        reason = "empty_document" if exc.problem == "document is empty" else "schema_error"
        return _dead(str(doc.id), source, reason, str(exc))
    if _is_empty(doc):
        return _dead(doc.id, source, "empty_document", f"{doc.record} has no text and no images")
    return doc


def _json_lines(path: str) -> Iterator[tuple[str, Any] | DeadLetter]:
    """``(line id, parsed object)`` per non-blank line, or a dead letter for bad UTF-8 / bad JSON."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield _dead(where, path, "bad_utf8", f"line {lineno}: {exc}")
                continue
            try:
                yield where, json.loads(text)
            except ValueError as exc:
                yield _dead(where, path, "bad_json", f"line {lineno}: {exc}")


def _from_segments_row(data: Any, where: str, path: str, source: str) -> Record:
    if not isinstance(data, Mapping):
        return _dead(where, path, "bad_record", f"expected an object, got {type(data).__name__}")
    data = {"source": source, "metadata": {}, **data}
    if not data.get("segments") and data.get("id"):
        return _dead(str(data["id"]), path, "empty_document", f"document {data['id']!r} has no segments")
    try:
        doc = Document.from_dict(data)
    except SchemaError as exc:
        return _dead(str(data.get("id") or where), path, "schema_error", str(exc))
    return _checked(doc, path)


def read_jsonl(path: str) -> Iterator[Record]:
    source = f"jsonl:{Path(path).name}"
    for item in _json_lines(path):
        yield item if isinstance(item, DeadLetter) else _from_segments_row(item[1], item[0], path, source)


def _interleaved(texts: list[Any], images: list[Any], image_of: Callable[[Any], Segment]) -> tuple[Segment, ...]:
    """OBELICS/MINT parallel lists: at each position exactly one of text or image is set."""
    if len(texts) != len(images):
        raise SchemaError("record", "texts", f"{len(texts)} texts but {len(images)} images")
    segments = []
    for i, (text, image) in enumerate(zip(texts, images)):
        if (text is None) == (image is None):
            raise SchemaError("record", f"texts[{i}]", "exactly one of texts[i] and images[i] must be set")
        segments.append(Segment.of_text(text) if text is not None else image_of(image))
    return tuple(segments)


def _obelics_image(entry: Any) -> Segment:
    if isinstance(entry, str):
        return Segment.of_image(ref=entry)
    if isinstance(entry, Mapping) and (entry.get("bytes") or entry.get("path")):
        return Segment.of_image(data=entry.get("bytes") or None, ref=entry.get("path") or None)
    raise SchemaError("record", "images", f"image entry must be a reference or {{bytes, path}}, got {entry!r}")


def _json_field(value: Any, field: str) -> Any:
    if value is None or isinstance(value, (Mapping, list)):
        return value if value is not None else {}
    return parse_json(value, "record", field)


def _obelics_row(row: Mapping[str, Any], where: str, path: str, source: str) -> Record:
    try:
        general = _json_field(row.get("general_metadata"), "general_metadata")
        general = general if isinstance(general, Mapping) else {}
        doc_id = str(general.get("id") or general.get("url") or where)
        segments = _interleaved(list(row.get("texts") or []), list(row.get("images") or []), _obelics_image)
        metadata = {"general_metadata": general, "image_metadata": _json_field(row.get("metadata"), "metadata")}
    except SchemaError as exc:
        return _dead(where, path, "bad_record", str(exc))
    return _checked(Document(id=doc_id, source=source, segments=segments, metadata=metadata), path)


def read_obelics(path: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    source = f"obelics:{Path(path).name}"
    row_index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
        for row in batch.to_pylist():
            yield _obelics_row(row, f"{path}:{row_index}", path, source)
            row_index += 1


def read_mint(path: str) -> Iterator[Record]:
    import webdataset as wds

    source = f"mint:{Path(path).name}"
    errors: list[DeadLetter] = []

    def on_error(exc: Exception) -> bool:
        errors.append(_dead(f"{path}:?", path, "bad_record", f"unreadable tar member: {exc}"))
        return True

    for sample in wds.WebDataset(path, shardshuffle=False, handler=on_error, empty_check=False):
        yield from errors
        errors.clear()
        key = sample["__key__"]
        raw = sample.get("json")
        if raw is None:
            yield _dead(key, path, "bad_record", f"sample {key!r} has no .json member")
            continue
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            yield _dead(key, path, "bad_utf8", f"{key}.json: {exc}")
            continue
        except ValueError as exc:
            yield _dead(key, path, "bad_json", f"{key}.json: {exc}")
            continue

        def member_image(entry: Any, _sample: Mapping[str, Any] = sample) -> Segment:
            if isinstance(entry, str) and entry in _sample and entry not in ("json", "__key__", "__url__"):
                return Segment.of_image(data=_sample[entry])
            if isinstance(entry, str):
                return Segment.of_image(ref=entry)
            raise SchemaError("record", "images", f"image entry must be a member extension or reference, got {entry!r}")

        try:
            if not isinstance(data, Mapping):
                raise SchemaError("record", "<root>", "json member must hold an object")
            segments = _interleaved(list(data.get("texts") or []), list(data.get("images") or []), member_image)
        except SchemaError as exc:
            yield _dead(key, path, "bad_record", str(exc))
            continue
        metadata = {k: v for k, v in data.items() if k not in ("texts", "images")}
        yield _checked(Document(id=key, source=source, segments=segments, metadata=metadata), path)
    yield from errors


def _mmc4_row(data: Any, where: str, path: str, source: str) -> Record:
    if not isinstance(data, Mapping):
        return _dead(where, path, "bad_record", f"expected an object, got {type(data).__name__}")
    doc_id = str(data.get("id") or data.get("url") or where)
    texts = data.get("text_list")
    infos = data.get("image_info") or []
    if not isinstance(texts, list) or not isinstance(infos, list):
        return _dead(doc_id, path, "bad_record", "text_list and image_info must be lists")
    before: dict[int, list[Segment]] = {}
    for n, info in enumerate(infos):
        index = info.get("matched_text_index") if isinstance(info, Mapping) else None
        name = info.get("image_name") if isinstance(info, Mapping) else None
        if not isinstance(index, int) or not 0 <= index < max(len(texts), 1) or not isinstance(name, str):
            return _dead(doc_id, path, "bad_record", f"image_info[{n}] needs image_name and a valid matched_text_index")
        before.setdefault(index, []).append(Segment.of_image(ref=name))
    segments: list[Segment] = []
    for i, text in enumerate(texts):
        segments.extend(before.get(i, []))
        if not isinstance(text, str):
            return _dead(doc_id, path, "bad_record", f"text_list[{i}] is not a string")
        segments.append(Segment.of_text(text))
    metadata = {k: v for k, v in data.items() if k not in ("text_list", "image_info")}
    return _checked(Document(id=doc_id, source=source, segments=tuple(segments), metadata=metadata), path)


def read_mmc4(path: str) -> Iterator[Record]:
    source = f"mmc4:{Path(path).name}"
    for item in _json_lines(path):
        yield item if isinstance(item, DeadLetter) else _mmc4_row(item[1], item[0], path, source)


def read_hf(path: str) -> Iterator[Record]:
    import datasets

    dataset = datasets.load_from_disk(path)
    if isinstance(dataset, datasets.DatasetDict):
        splits: Iterable[tuple[str, datasets.Dataset]] = sorted(dataset.items())
    else:
        splits = [("", dataset)]
    for split, table in splits:
        source = f"hf:{Path(path).name}{'/' + split if split else ''}"
        layout = "segments" if "segments" in table.column_names else "obelics"
        for i, row in enumerate(table):
            where = f"{path}:{split}:{i}" if split else f"{path}:{i}"
            if layout == "segments":
                row = {**row, "segments": [{k: v for k, v in s.items() if v is not None} for s in row["segments"] or []]}
                yield _from_segments_row(row, where, path, source)
            else:
                yield _obelics_row(row, where, path, source)


FORMATS: dict[str, Callable[[str], Iterator[Record]]] = {
    "jsonl": read_jsonl,
    "obelics": read_obelics,
    "mint": read_mint,
    "mmc4": read_mmc4,
    "hf": read_hf,
}


def read_file(path: str, fmt: str) -> Iterator[Record]:
    """All records of one input file (or ``hf`` folder) in the given format."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {sorted(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt](path)
