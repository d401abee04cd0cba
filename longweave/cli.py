"""The ``longweave`` console script: a thin dispatcher; each subcommand lives with the part it drives."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Modules that each define ``register(subparsers)``; the order is the order of ``longweave --help``.
COMMAND_MODULES = ("longweave.corpus.command", "pipeline.command", "pipeline.inspect.command", "trainer.train",
                   "trainer.stage_command", "longweave.demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longweave", description="Multimodal long-context training stack.")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return int(args.handler(args, extra) or 0)


if __name__ == "__main__":
    sys.exit(main())
