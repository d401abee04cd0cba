"""``longweave demo``: the main job on the built-in corpus, end to end, on whatever hardware is present.

Today it builds the sample corpus and prints its summary; the pipeline, inspection and trainer steps join here as
they land.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from longweave.corpus.build import build_corpus
from longweave.corpus.command import summary_table


def run(args: argparse.Namespace, _extra: list[str]) -> int:
    console = Console()
    corpus_dir = args.workdir / "corpus"
    with console.status("building the sample corpus"):
        summary = build_corpus(corpus_dir)
    console.print(summary_table(summary, title=f"sample corpus in {corpus_dir}"))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run the main job on the built-in sample corpus")
    parser.add_argument("--workdir", type=Path, default=Path("demo_out"), help="folder for everything the demo writes")
    parser.set_defaults(handler=run)
