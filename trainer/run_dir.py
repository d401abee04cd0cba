"""The run folder: what a training run writes, and where. One place names every file, so `train` and `stage` agree.

    RUN/config.json          the resolved TrainConfig (written at start; a resume with another config is refused)
    RUN/fingerprints.json    tokenizer and vision fingerprints of the run (from its first stage's manifest)
    RUN/curriculum.json      the current stage (moved by `longweave stage advance` or by the trainer)
    RUN/transitions.jsonl    one line per stage transition
    RUN/checkpoints/<tag>/   DeepSpeed engine state + trainer_state.json (written last: its presence = complete)
    RUN/metrics.jsonl        one line per optimizer step; RUN/tensorboard/ the same for TensorBoard
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from trainer.config import TrainConfig

__all__ = ["RunDir", "write_json_atomic"]

TRAINER_STATE = "trainer_state.json"


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


@dataclasses.dataclass(frozen=True, slots=True)
class RunDir:
    root: Path

    @property
    def config_path(self) -> Path:
        return self.root / "config.json"

    @property
    def fingerprints_path(self) -> Path:
        return self.root / "fingerprints.json"

    @property
    def curriculum_path(self) -> Path:
        return self.root / "curriculum.json"

    @property
    def transitions_path(self) -> Path:
        return self.root / "transitions.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    def load_config(self) -> TrainConfig:
        if not self.config_path.is_file():
            raise FileNotFoundError(f"{self.root}: not a training run (no config.json)")
        return TrainConfig.from_dict(json.loads(self.config_path.read_text()))

    def current_stage(self, config: TrainConfig) -> str:
        if self.curriculum_path.is_file():
            return json.loads(self.curriculum_path.read_text())["stage"]
        return config.stages[0].name

    def fingerprints(self) -> dict[str, str]:
        return json.loads(self.fingerprints_path.read_text())

    def complete_checkpoints(self) -> list[Path]:
        """Checkpoint folders whose trainer state was written (the last file of a save), oldest first."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(p for p in self.checkpoints.iterdir() if (p / TRAINER_STATE).is_file())

    def latest_checkpoint(self) -> Path | None:
        found = self.complete_checkpoints()
        return found[-1] if found else None

    @staticmethod
    def trainer_state(checkpoint: Path) -> dict[str, Any]:
        return json.loads((checkpoint / TRAINER_STATE).read_text())
