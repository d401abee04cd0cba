"""Benchmark: ``inspect --verify`` throughput against ``sha256sum`` over the same shard files, in the same run.

    python -m pipeline.inspect.bench PACK_OUTPUT [--repeat 5]

The files are read once first so both sides find them in the page cache (hashing, not the disk, is then the floor
sha256sum sets); they are timed alternately, wall clock, and the medians compared. A second anchor, Python's
``hashlib`` (OpenSSL, which uses the CPU's SHA extensions where coreutils may not), shows the hashing floor itself.
``verify`` is timed in process (imports and tokenizer loading excluded), covering everything ``--verify`` does:
hashing, tar walk, every sample check, reconciliation.
"""
from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pipeline.inspect.target import resolve_target
from pipeline.inspect.verify import sha256_file, verify
from tokenization.tokenizer import load_tokenizer
from vision.geometry import DEFAULT_POLICY

log = logging.getLogger(__name__)


def _warm(files: list[Path]) -> None:
    for path in files:
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


def _time_sha256sum(files: list[Path]) -> float:
    started = time.perf_counter()
    subprocess.run([shutil.which("sha256sum") or "sha256sum", *map(str, files)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a longweave pack output folder (or one stage folder)")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds of each (median reported)")
    parser.add_argument("--decode-images", action="store_true", help="time verify with full image decoding")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    target = resolve_target(args.path)
    files = [p for stage in target.stages for p in stage.shards]
    size = sum(p.stat().st_size for p in files)
    tokenizer = load_tokenizer()
    log.info("%d shard(s), %.1f MiB; warming the page cache", len(files), size / 2**20)
    _warm(files)
    sha, openssl, ver = [], [], []
    for round_ in range(args.repeat):
        sha.append(_time_sha256sum(files))
        started = time.perf_counter()
        for path in files:
            sha256_file(path)
        openssl.append(time.perf_counter() - started)
        started = time.perf_counter()
        report = verify(target, tokenizer, DEFAULT_POLICY, decode_images=args.decode_images)
        ver.append(time.perf_counter() - started)
        if not report.ok:
            raise SystemExit(f"verify found {len(report.problems)} problem(s); benchmark a clean pack output")
        log.info("round %d: sha256sum %.3f s, hashlib %.3f s, verify %.3f s", round_ + 1, sha[-1], openssl[-1], ver[-1])
    table = Table(title=f"inspect --verify vs sha256sum: {len(files)} shards, {size / 2**20:,.1f} MiB, "
                        f"{report.samples:,} samples")
    for column in ("tool", "median s", "min s", "MiB/s (median)"):
        table.add_column(column, justify="right")
    for name, times in (("sha256sum", sha), ("hashlib sha256 (OpenSSL)", openssl), ("inspect --verify", ver)):
        median = statistics.median(times)
        table.add_row(name, f"{median:.3f}", f"{min(times):.3f}", f"{size / 2**20 / median:,.0f}")
    Console().print(table)
    Console().print(f"verify speed / sha256sum speed = {statistics.median(sha) / statistics.median(ver):.2f} (target "
                    f">= 0.50); / hashlib speed = {statistics.median(openssl) / statistics.median(ver):.2f}; raw s: "
                    f"sha256sum {[round(t, 3) for t in sha]}, hashlib {[round(t, 3) for t in openssl]}, "
                    f"verify {[round(t, 3) for t in ver]}", soft_wrap=True)


if __name__ == "__main__":
    main()
