"""``longweave corpus --output DIR``: build the sample corpus and print its summary."""
from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from longweave.corpus.build import CorpusSummary, build_corpus


def summary_table(summary: CorpusSummary, title: str = "sample corpus") -> Table:
    table = Table(title=title)
    table.add_column("measure")
    table.add_column("value", justify="right")
    for label, value in (("documents", summary.documents), ("tokens", summary.tokens), ("images", summary.images),
                         ("shortest document (tokens)", summary.min_tokens),
                         ("longest document (tokens)", summary.max_tokens)):
        table.add_row(label, f"{value:,}")
    for bucket, count in summary.histogram.items():
        table.add_row(f"documents of {bucket} tokens", f"{count:,}")
    return table


def run(args: argparse.Namespace, _extra: list[str]) -> int:
    summary = build_corpus(args.output)
    Console().print(summary_table(summary, title=f"sample corpus in {args.output}"))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("corpus", help="build the built-in sample corpus (JSONL + OBELICS parquet)")
    parser.add_argument("--output", type=Path, required=True, help="folder to write the corpus into")
    parser.set_defaults(handler=run)
