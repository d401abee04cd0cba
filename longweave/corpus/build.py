"""The built-in sample corpus: real prose interleaved with real photographs, written as JSONL and OBELICS parquet.

Documents come from package documentation that ships offline (see ``docstrings``): one document per module for the
standard library, numpy and scikit-image (about 100 to 60K tokens), and one document per scipy subpackage, its modules
in order (tens of thousands to several hundred thousand tokens), so every curriculum stage has real input. Each document
gets 0 to 10 photographs (``photos``), each preceded by its caption, at positions drawn from a generator seeded by the
document id: the same pinned packages give byte-identical output on every machine.

Layout of the output folder::

    images/<name>                 the photographs, byte-identical copies
    documents.jsonl               one ``schemas.Document`` per line (images as references under images/)
    obelics/part-00000.parquet    the same documents as OBELICS rows (texts/images parallel lists)
    summary.json                  documents, tokens, images, length histogram
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
import shutil
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from longweave.corpus.docstrings import ModuleDocs, iter_module_docs
from longweave.corpus.photos import Photo, shipped_photos
from schemas.document import Document, Segment
from tokenization.tokenizer import TextTokenizer, load_tokenizer
from vision.geometry import DEFAULT_POLICY, VisionPolicy

__all__ = ["CorpusConfig", "CorpusSummary", "build_corpus", "OBELICS_SCHEMA", "LENGTH_EDGES"]

OBELICS_SCHEMA = pa.schema(
    [
        pa.field("images", pa.list_(pa.string())),
        pa.field("texts", pa.list_(pa.string())),
        pa.field("metadata", pa.string()),
        pa.field("general_metadata", pa.string()),
    ]
)
LENGTH_EDGES = (0, 512, 2048, 8192, 65536, 262144, 1048576)
MAX_IMAGES_PER_DOCUMENT = 10
_PARAGRAPH_END = re.compile(r"(?<=\n\n)(?=[^\n])")  # split after a blank line, keeping it


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CorpusConfig:
    """Which packages feed the corpus. The defaults make the demo corpus; tests pass smaller selections."""

    module_packages: tuple[str, ...] = ("stdlib", "numpy", "skimage")
    subpackage_documents: tuple[str, ...] = ("scipy",)
    min_chars: int = 400  # about 100 tokens: shorter modules carry too little prose to be a document


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CorpusSummary:
    documents: int
    tokens: int
    images: int
    min_tokens: int
    max_tokens: int
    histogram: dict[str, int]  # "lo-hi" token range -> documents

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _rng(doc_id: str) -> random.Random:
    return random.Random(int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big"))


def _text_segments(modules: Iterable[ModuleDocs]) -> list[Segment]:
    """One text segment per paragraph, like OBELICS, so long documents can be split close to the sequence length."""
    return [
        Segment.of_text(paragraph)
        for module in modules
        for name, doc in module.entries
        for paragraph in _PARAGRAPH_END.split(f"{name}\n\n{doc}\n\n")
        if paragraph
    ]


def _interleave(doc_id: str, texts: list[Segment], photos: list[Photo]) -> tuple[Segment, ...]:
    """Insert 0–10 captioned photographs between text segments, chosen by a generator seeded with the id."""
    rng = _rng(doc_id)
    # A third of documents are image-rich (up to 10); the rest hold 0–2, like web documents.
    n_images = rng.randint(0, MAX_IMAGES_PER_DOCUMENT) if rng.random() < 1 / 3 else rng.randint(0, 2)
    gaps = sorted(rng.choices(range(len(texts) + 1), k=n_images))
    out: list[Segment] = []
    for i in range(len(texts) + 1):
        while gaps and gaps[0] == i:
            gaps.pop(0)
            photo = rng.choice(photos)
            out.append(Segment.of_text(f"Figure. {photo.caption}\n"))
            out.append(Segment.of_image(ref=photo.name))
        if i < len(texts):
            out.append(texts[i])
    return tuple(out)


def corpus_documents(config: CorpusConfig, photos: list[Photo]) -> list[Document]:
    """All documents of the corpus, sorted by id."""
    docs: list[Document] = []
    for package in config.module_packages:
        for module in iter_module_docs(package, min_chars=config.min_chars):
            doc_id = f"{package}/{module.module}"
            segments = _interleave(doc_id, _text_segments([module]), photos)
            docs.append(Document(id=doc_id, source=f"docstrings:{package}", segments=segments,
                                 metadata={"module": module.module}))
    for package in config.subpackage_documents:
        groups: dict[str, list[ModuleDocs]] = {}
        for module in iter_module_docs(package, min_chars=1):
            parts = module.module.split(".")
            groups.setdefault(".".join(parts[:2]), []).append(module)
        for name, modules in sorted(groups.items()):
            if sum(m.chars for m in modules) < config.min_chars:
                continue
            doc_id = f"{package}/{name}"
            segments = _interleave(doc_id, _text_segments(modules), photos)
            docs.append(Document(id=doc_id, source=f"docstrings:{package}", segments=segments,
                                 metadata={"subpackage": name, "modules": len(modules)}))
    return sorted((d.validate() for d in docs), key=lambda d: d.id)


def _obelics_row(doc: Document) -> dict[str, object]:
    texts = [s.text if s.kind == "text" else None for s in doc.segments]
    images = [s.image_ref if s.kind == "image" else None for s in doc.segments]
    image_meta = [{"caption_source": "package docstring"} if s.kind == "image" else None for s in doc.segments]
    general = {"url": f"sample://{doc.id}", "source": doc.source, **doc.metadata}
    return {
        "images": images,
        "texts": texts,
        "metadata": json.dumps(image_meta, sort_keys=True),
        "general_metadata": json.dumps(general, sort_keys=True),
    }


def summarize(docs: list[Document], sizes: dict[str, tuple[int, int]], tokenizer: TextTokenizer,
              policy: VisionPolicy) -> CorpusSummary:
    """Token counts under the real layout, images sized as they will decode."""
    lengths = []
    for doc in docs:
        sized = tuple(
            dataclasses.replace(s, width=sizes[s.image_ref][0], height=sizes[s.image_ref][1]) if s.kind == "image" else s
            for s in doc.segments
        )
        lengths.append(len(tokenizer.encode_document(dataclasses.replace(doc, segments=sized), policy)))
    histogram: Counter[str] = Counter()
    labels = [f"{lo}-{hi}" for lo, hi in zip(LENGTH_EDGES, LENGTH_EDGES[1:])] + [f"{LENGTH_EDGES[-1]}-inf"]
    for n in lengths:
        histogram[labels[sum(n >= edge for edge in LENGTH_EDGES[1:])]] += 1
    return CorpusSummary(
        documents=len(docs),
        tokens=sum(lengths),
        images=sum(len(d.images) for d in docs),
        min_tokens=min(lengths),
        max_tokens=max(lengths),
        histogram={label: histogram[label] for label in labels},
    )


def build_corpus(output: str | Path, config: CorpusConfig = CorpusConfig(), *,
                 tokenizer: TextTokenizer | None = None, policy: VisionPolicy = DEFAULT_POLICY) -> CorpusSummary:
    """Write the corpus under ``output`` (replacing an earlier build there) and return its summary."""
    out = Path(output)
    photos = shipped_photos()
    docs = corpus_documents(config, photos)
    for sub in ("images", "obelics"):
        shutil.rmtree(out / sub, ignore_errors=True)
        (out / sub).mkdir(parents=True)
    sizes = {}
    for photo in photos:
        shutil.copyfile(photo.path, out / "images" / photo.name)
        with Image.open(photo.path) as im:
            sizes[photo.name] = im.size
    with open(out / "documents.jsonl", "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(doc.to_json() + "\n")
    table = pa.Table.from_pylist([_obelics_row(d) for d in docs], schema=OBELICS_SCHEMA)
    pq.write_table(table, out / "obelics" / "part-00000.parquet", compression="zstd")
    summary = summarize(docs, sizes, tokenizer or load_tokenizer(), policy)
    (out / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2) + "\n", encoding="utf-8")
    return summary
