"""``longweave inspect PATH``: look at ``longweave pack`` output before spending GPU time on it.

PATH is a pack output folder, one stage folder, or one shard. Without options: a summary per stage. ``--sample`` shows
one sample decoded (``--export DIR`` writes its text and images), ``--verify`` checks everything and exits 1 listing
every problem, ``--html`` writes a self-contained report, ``--json`` prints the summary (or the verify result) as JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from pipeline.inspect.reader import ShardReadError
from pipeline.inspect.target import resolve_target
from tokenization.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from vision.geometry import DEFAULT_POLICY

__all__ = ["register", "run_inspect"]
log = logging.getLogger(__name__)


def run_inspect(args: argparse.Namespace, console: Console) -> int:
    """The command's work; returns the exit status (1: problems found or the request failed)."""
    try:
        target = resolve_target(args.path)
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[red]inspect: {escape(str(exc))}[/red]", soft_wrap=True)
        return 2
    tokenizer = load_tokenizer(args.tokenizer)
    status = 0
    if args.verify:
        from pipeline.inspect.verify import print_report, verify

        report = verify(target, tokenizer, DEFAULT_POLICY, decode_images=args.decode_images)
        if args.json:
            sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
        else:
            print_report(report, console)
        status = 0 if report.ok else 1
    if args.sample is not None:
        from pipeline.inspect.sample_view import export_sample, find_sample, print_sample, sample_parts

        try:
            sample = find_sample(target, args.sample)
            parts = sample_parts(sample, tokenizer)
            print_sample(sample, parts, console)
            if args.export:
                for path in export_sample(sample, parts, args.export):
                    log.info("exported %s", path)
        except (LookupError, ShardReadError, ValueError, OSError) as exc:
            console.print(f"[red]inspect --sample: {escape(str(exc))}[/red]", soft_wrap=True)
            return 1
    if args.html or not (args.verify or args.sample is not None):
        from pipeline.inspect.summary import print_summary, summarize

        summaries = summarize(target)
        if args.html:
            from pipeline.inspect.report_html import write_report

            write_report(args.html, target, summaries, tokenizer)
        elif args.json:
            sys.stdout.write(json.dumps([s.to_dict() for s in summaries], indent=2) + "\n")
        else:
            print_summary(summaries, console, target.root)
    return status


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    if args.export and args.sample is None:
        raise SystemExit("inspect: --export needs --sample")
    return run_inspect(args, Console())


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("inspect", help="summarise, show, verify or report packed shards",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="pack output folder, stage folder, or one .tar shard")
    parser.add_argument("--sample", metavar="KEY|INDEX", default=None, help="show one sample (key, or index from 0)")
    parser.add_argument("--export", metavar="DIR", type=Path, default=None,
                        help="with --sample: write its text, meta.json and images under DIR")
    parser.add_argument("--verify", action="store_true", help="check everything; exit 1 listing every problem")
    parser.add_argument("--decode-images", action="store_true",
                        help="with --verify: decode every image fully (slower), not only header and end marker")
    parser.add_argument("--html", metavar="REPORT.html", type=Path, default=None, help="write a self-contained report")
    parser.add_argument("--json", action="store_true", help="print the summary, or the verify result, as JSON")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER_PATH,
                        help="tokenizer.json the shards were packed with (default: the shipped one)")
    parser.set_defaults(handler=_run)
