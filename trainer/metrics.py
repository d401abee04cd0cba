"""Per-step metrics to JSONL and TensorBoard (rank 0 only), and the truncation a resume needs."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter", "truncate_metrics"]


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines past ``last_step``: a resumed run replays those steps and must not log them twice."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


class MetricsWriter:
    def __init__(self, jsonl: Path, tensorboard: Path, enabled: bool) -> None:
        self.enabled = enabled
        self._file = open(jsonl, "a", encoding="utf-8") if enabled else None
        self._tb = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(tensorboard))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                self._tb.add_scalar(f"{record['stage']}/{key}" if key == "loss" else key, value, record["step"])

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tb.close()
