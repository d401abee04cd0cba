"""Throughput of ``longweave pack`` against the tokenizer alone on the same text (the floor), in one run.

    python -m pipeline.bench [--min-mb 200] [--stages 8k] [--workdir /tmp/longweave-bench]

The sample corpus is repeated (ids made unique per copy) until the JSONL input reaches ``--min-mb``. Both sides run
with one tokenizer thread (``RAYON_NUM_THREADS=1``) in one worker, so the figures are per worker. Images repeat across
copies, so the job's per-worker image cache serves most of them after the first copy, as it does for the logos and
icons that recur in web corpora.
"""
from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before tokenizers loads: one thread per worker on both sides

import argparse
import json
import time
from pathlib import Path

from longweave.cli import main as cli_main
from longweave.corpus.build import build_corpus
from schemas.document import Document
from tokenization.tokenizer import load_tokenizer


def scaled_input(workdir: Path, min_mb: float) -> tuple[Path, Path]:
    corpus = workdir / "corpus"
    if not (corpus / "documents.jsonl").exists():
        build_corpus(corpus)
    lines = (corpus / "documents.jsonl").read_text(encoding="utf-8").splitlines()
    copies = max(1, int(min_mb * 2**20 // sum(len(line.encode()) + 1 for line in lines)) + 1)
    path = workdir / f"scaled-{copies}x.jsonl"
    if not path.exists():
        with open(path, "w", encoding="utf-8") as f:
            for k in range(copies):
                for line in lines:
                    data = json.loads(line)
                    data["id"] = f"copy{k:03d}/{data['id']}"
                    f.write(json.dumps(data, ensure_ascii=False) + "\n")
    return path, corpus / "images"


def tokenizer_alone(path: Path) -> dict[str, float]:
    """Parse each line and tokenize its text segments: the least any packing job must do."""
    tokenizer = load_tokenizer()
    start = time.perf_counter()
    docs = tokens = 0
    with open(path, "rb") as f:
        for raw in f:
            doc = Document.from_json(raw)
            texts = [s.text for s in doc.segments if s.kind == "text"]
            tokens += sum(len(ids) for ids in tokenizer.encode_batch(texts))
            docs += 1
    return {"seconds": time.perf_counter() - start, "documents": docs, "text_tokens": tokens}


def whole_job(path: Path, images: Path, out: Path, stages: str) -> dict[str, float]:
    start = time.perf_counter()
    rc = cli_main(["pack", "--input", str(path), "--format", "jsonl", "--output", str(out), "--image-root", str(images),
                   "--stages", stages, "--direct_num_workers=1"])
    assert rc == 0
    run = json.loads((out / "run.json").read_text())
    return {"seconds": time.perf_counter() - start, "documents": run["metrics"]["records_read"],
            "tokens": run["metrics"]["tokens"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-mb", type=float, default=200.0)
    parser.add_argument("--stages", default="8k")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/longweave-bench"))
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    path, images = scaled_input(args.workdir, args.min_mb)
    mb = path.stat().st_size / 2**20
    floor = tokenizer_alone(path)
    job = whole_job(path, images, args.workdir / "out", args.stages)
    result = {
        "input_mb": round(mb, 1),
        "tokenizer_alone": {**floor, "docs_per_s": floor["documents"] / floor["seconds"],
                            "tokens_per_s": floor["text_tokens"] / floor["seconds"], "mb_per_s": mb / floor["seconds"]},
        "job": {**job, "docs_per_s": job["documents"] / job["seconds"], "tokens_per_s": job["tokens"] / job["seconds"],
                "mb_per_s": mb / job["seconds"]},
    }
    result["job_over_floor"] = floor["seconds"] / job["seconds"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
