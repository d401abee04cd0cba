"""Same input and config give byte-identical shards and manifests: across reruns, runners, worker counts, and kills."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from longweave.cli import main


def _pack_args(corpus: Path, out: Path) -> list[str]:
    return ["pack", "--input", str(corpus / "documents.jsonl"), "--format", "jsonl", "--output", str(out),
            "--image-root", str(corpus / "images"), "--stages", "8k,64k"]


def _digests(out: Path) -> dict[str, str]:
    """sha256 of every output file but run.json (which records timings)."""
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != "run.json"}


def test_rerun_gives_identical_bytes(small_corpus: Path, packed_small: Path, tmp_path: Path) -> None:
    assert main(_pack_args(small_corpus, tmp_path / "again")) == 0
    reference = _digests(packed_small)
    assert any(name.endswith(".tar") for name in reference) and any("manifest" in n for n in reference)
    assert _digests(tmp_path / "again") == reference


def test_multiprocessing_workers_give_identical_bytes(small_corpus: Path, packed_small: Path, tmp_path: Path) -> None:
    out = tmp_path / "mp"
    assert main(_pack_args(small_corpus, out) + ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]) == 0
    assert _digests(out) == _digests(packed_small)


def test_killed_job_leaves_no_partial_shard_and_rerun_matches(small_corpus: Path, packed_small: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "longweave.cli", *_pack_args(small_corpus, out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not list(out.glob("*/.*.tmp")):
        time.sleep(0.002)
    saw_temp = bool(list(out.glob("*/.*.tmp")))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    reference = _digests(packed_small)
    for shard in out.glob("*/*.tar"):  # whatever carries a final name is complete
        assert hashlib.sha256(shard.read_bytes()).hexdigest() == reference[shard.relative_to(out).as_posix()]
    assert saw_temp, "the job was not caught mid-write"
    assert main(_pack_args(small_corpus, out)) == 0
    assert _digests(out) == reference
