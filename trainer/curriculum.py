"""Stage plans and transitions, shared by ``longweave stage`` and the trainer's own advance at a spent budget.

A transition checks that the next stage's manifest exists and was packed with the run's tokenizer and vision policy,
then points ``curriculum.json`` at it and appends to ``transitions.jsonl``. The optimizer, the LR schedule (a function
of the global step) and the step counter carry over; the loader starts the new manifest from its beginning.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from schemas.errors import SchemaError
from schemas.manifest import MANIFEST_NAME, ShardManifest
from trainer.config import Recompute, StageRun, TrainConfig
from trainer.run_dir import RunDir, write_json_atomic

__all__ = ["StageError", "StagePlan", "plan_stage", "stage_manifest", "check_fingerprints", "next_stage", "advance"]


class StageError(RuntimeError):
    """A stage transition that must not happen (missing manifest, foreign fingerprints, no checkpoint…)."""


@dataclasses.dataclass(frozen=True, slots=True)
class StagePlan:
    stage: str
    seq_len: int
    micro_batch: int
    grad_accum: int
    world_size: int
    tokens_per_step: int
    steps: int
    token_budget: int
    activation_checkpointing: Recompute
    vision_checkpointing: Recompute
    keep_routed_rows: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan_stage(config: TrainConfig, stage: StageRun, world_size: int) -> StagePlan:
    return StagePlan(stage=stage.name, seq_len=stage.seq_len, micro_batch=stage.micro_batch,
                     grad_accum=config.grad_accum(stage, world_size), world_size=world_size,
                     tokens_per_step=config.tokens_per_step, steps=config.steps_in(stage),
                     token_budget=stage.token_budget, activation_checkpointing=config.checkpointing(stage),
                     vision_checkpointing=config.vision_checkpointing(stage), keep_routed_rows=stage.keep_routed_rows)


def stage_manifest(config: TrainConfig, stage: StageRun) -> ShardManifest:
    path = Path(config.data) / stage.name / MANIFEST_NAME
    if not path.is_file():
        raise StageError(f"stage {stage.name!r}: no manifest at {path} (pack it first with `longweave pack`)")
    try:
        manifest = ShardManifest.from_json(path.read_text())
    except SchemaError as exc:
        raise StageError(f"stage {stage.name!r}: manifest {path} is invalid: {exc}") from None
    if manifest.stage.seq_len != stage.seq_len:
        raise StageError(f"stage {stage.name!r}: manifest {path} packs seq_len {manifest.stage.seq_len}, "
                         f"the run expects {stage.seq_len}")
    return manifest


def check_fingerprints(manifest: ShardManifest, expected: dict[str, str], where: str) -> None:
    for key, field in (("tokenizer", "tokenizer_fingerprint"), ("vision", "vision_fingerprint")):
        found = getattr(manifest, field)
        if found != expected[key]:
            raise StageError(f"{where}: {key} fingerprint {found[:12]}… does not match the run's "
                             f"{expected[key][:12]}… (shards packed with another {key}); refusing the transition")


def next_stage(config: TrainConfig, current: str, to: str | None = None) -> StageRun:
    index = config.stage_index(current)
    if to is not None:
        target = config.stage(to)
        if config.stage_index(target.name) <= index:
            raise StageError(f"--to {to!r}: the run is already at stage {current!r}; stages only move forward")
        return target
    if index + 1 >= len(config.stages):
        raise StageError(f"stage {current!r} is the last stage of this run")
    return config.stages[index + 1]


def advance(run: RunDir, config: TrainConfig, world_size: int, to: str | None = None,
            state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Move the run to its next stage (or ``to``); returns the transition record.

    Where the run stands comes from its newest checkpoint, or from ``state`` (the trainer's in-memory
    ``TrainerState.to_dict()``) in a run that writes no checkpoints (``save_checkpoints: false``)."""
    checkpoint = None
    if state is None:
        checkpoint = run.latest_checkpoint()
        if checkpoint is None:
            raise StageError(f"{run.root}: the run has no complete checkpoint; train before advancing")
        state = run.trainer_state(checkpoint)["trainer"]
    current = run.current_stage(config)
    target = next_stage(config, current, to)
    manifest = stage_manifest(config, target)
    check_fingerprints(manifest, run.fingerprints(), f"stage {target.name!r}")
    plan = plan_stage(config, target, world_size)
    record = {
        "time": time.time(),
        "from": current,
        "to": target.name,
        "checkpoint": checkpoint.name if checkpoint is not None else None,
        "step": state["step"],
        "tokens": state["tokens"],
        "tokens_in_previous_stage": state["stage_tokens"] if state["stage"] == current else 0,
        "plan": plan.to_dict(),
        "manifest_samples": manifest.total_samples,
    }
    write_json_atomic(run.curriculum_path, {"stage": target.name, "since_step": state["step"]})
    with open(run.transitions_path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
    return record
