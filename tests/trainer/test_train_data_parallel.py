"""Data parallel on the CPU: two gloo ranks train like one process on the same global batch, and resume like it."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def _config(data: Path, steps: int) -> str:
    return (f"model: tiny\ndata: {data}\ntokens_per_step: 1024\nstages:\n"
            f"  - {{name: s512, seq_len: 512, micro_batch: 1, token_budget: {1024 * steps}}}\n"
            "lr: 0.01\nwarmup_steps: 1\nnum_workers: 1\ncheckpoint_every: 2\nkeep_checkpoints: 2\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(run: Path, config: Path | None, nproc: int, *extra: str) -> None:
    """What a launcher does: ``nproc`` processes with RANK, WORLD_SIZE, LOCAL_RANK and a rendezvous address."""
    cmd = [sys.executable, "-m", "trainer.train", "--run", str(run), *extra]
    cmd += ["--config", str(config)] if config is not None else []
    port = str(_free_port())
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={
        **os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for r in range(nproc)]
    errors = [proc.communicate(timeout=900)[1] for proc in procs]
    failed = [(r, err) for r, (proc, err) in enumerate(zip(procs, errors)) if proc.returncode != 0]
    assert not failed, "\n".join(f"rank {r}:\n{err[-3000:]}" for r, err in failed)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_match_one_process(short_shards: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(_config(short_shards, 4))
    one, two = tmp_path / "one", tmp_path / "two"
    _launch(one, config, 1)  # one process: 2 micro-batches of accumulation per step
    _launch(two, config, 2, "--max-steps", "2")  # two ranks: 1 micro-batch each per step
    _launch(two, None, 2)  # ...stopped, and resumed on two ranks from the step-2 checkpoint
    a, b = _metrics(one), _metrics(two)
    assert [m["step"] for m in b] == [m["step"] for m in a] == [1, 2, 3, 4]
    assert [m["sample_keys"] for m in b] == [m["sample_keys"] for m in a]  # the same global batches
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=2e-3)
    assert [m["grad_norm"] for m in b[:2]] == pytest.approx([m["grad_norm"] for m in a[:2]], rel=2e-2)
