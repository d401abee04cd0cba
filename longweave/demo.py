"""``longweave demo``: the main job on the built-in corpus, end to end, through the same commands a user runs.

corpus → ``pack`` (all four stages) → ``inspect --verify`` and ``--html`` → ``train`` the tiny model at 8K →
``stage advance`` → ``train`` at 64K → a summary. A GPU is used when there is one; two CPU cores are enough.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from longweave.corpus.build import build_corpus
from longweave.corpus.command import summary_table

TOKENS_PER_STEP = 65536  # 8 micro-batches at 8K, one at 64K: the same tokens per optimizer step in both stages
DEMO_STEPS = {"8k": 3, "64k": 2}


def _train_config(shards: Path) -> str:
    stages = "\n".join(
        f"  - {{name: {name}, seq_len: {seq}, micro_batch: 1, token_budget: {TOKENS_PER_STEP * DEMO_STEPS[name]}}}"
        for name, seq in (("8k", 8192), ("64k", 65536)))
    return (f"model: tiny\ndata: {shards}\ntokens_per_step: {TOKENS_PER_STEP}\nstages:\n{stages}\n"
            "lr: 0.003\nwarmup_steps: 1\ncheckpoint_every: 1000\nkeep_checkpoints: 1\nnum_workers: 1\n"
            "auto_advance: false\n")


def _cli(argv: list[str]) -> None:
    from longweave.cli import main

    rc = main(argv)
    if rc != 0:
        raise SystemExit(f"longweave demo: `longweave {' '.join(argv)}` exited with {rc}")


def run(args: argparse.Namespace, _extra: list[str]) -> int:
    console = Console()
    work: Path = args.workdir
    corpus, shards, run_dir = work / "corpus", work / "shards", work / "run"
    timings: dict[str, float] = {}

    def step(name: str) -> None:
        timings[name] = time.perf_counter()
        console.rule(f"[bold]{name}")

    step("corpus")
    with console.status("building the sample corpus"):
        summary = build_corpus(corpus)
    console.print(summary_table(summary, title=f"sample corpus in {corpus}"))
    step("pack")
    _cli(["pack", "--input", str(corpus / "documents.jsonl"), "--format", "jsonl", "--output", str(shards),
          "--image-root", str(corpus / "images")])
    step("inspect")
    _cli(["inspect", str(shards), "--verify"])
    _cli(["inspect", str(shards), "--html", str(work / "report.html")])
    step("train 8k")
    shutil.rmtree(run_dir, ignore_errors=True)
    (work / "train.yaml").write_text(_train_config(shards))
    _cli(["train", "--run", str(run_dir), "--config", str(work / "train.yaml")])
    step("stage advance")
    _cli(["stage", "advance", "--run", str(run_dir)])
    step("train 64k")
    _cli(["train", "--run", str(run_dir)])
    timings["end"] = time.perf_counter()

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pack = json.loads((shards / "run.json").read_text())
    table = Table(title="longweave demo")
    for col in ("stage", "samples", "fill", "trained steps", "first loss", "last loss", "tokens/s"):
        table.add_column(col, justify="right")
    for name, counts in pack["counts"].items():
        trained = [m for m in metrics if m["stage"] == name]
        table.add_row(name, f"{counts['samples']:,}", f"{counts['fill_ratio']:.2%}", str(len(trained)),
                      f"{trained[0]['loss']:.3f}" if trained else "-", f"{trained[-1]['loss']:.3f}" if trained else "-",
                      f"{sum(m['tokens_per_s'] for m in trained) / len(trained):,.0f}" if trained else "-")
    console.print(table)
    names = list(timings)
    console.print("seconds: " + ", ".join(f"{a} {timings[b] - timings[a]:.0f}" for a, b in zip(names, names[1:])))
    console.print(f"report: {work / 'report.html'}   run: {run_dir}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run the main job on the built-in sample corpus")
    parser.add_argument("--workdir", type=Path, default=Path("demo_out"), help="folder for everything the demo writes")
    parser.set_defaults(handler=run)
