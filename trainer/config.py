"""The run config: model preset, curriculum stages, optimizer and schedule, checkpoints. YAML maps onto it.

Tokens per optimizer step are fixed for the whole run; each stage derives its gradient accumulation from it:
``tokens_per_step = micro_batch × seq_len × grad_accum × data-parallel size``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["Recompute", "StageRun", "TrainConfig", "load_train_config", "recompute_label"]

# Activation checkpointing: true (every decoder layer recomputes in the backward), false (none), or N (the first N).
Recompute = bool | int


def _require(ok: bool, field: str, problem: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {problem}")


def _is_recompute(value: object) -> bool:
    return isinstance(value, bool) or (isinstance(value, int) and value >= 0)


def recompute_label(setting: Recompute) -> str:
    """How plans, logs and metrics show a stage's activation checkpointing."""
    if isinstance(setting, bool) or setting == 0:
        return "on" if setting else "off"
    return f"first {setting} layer{'' if setting == 1 else 's'}"


def _positive(owner: str, obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(isinstance(value, int) and not isinstance(value, bool) and value > 0, f"{owner}.{name}",
                 f"must be a positive int, got {value!r}")


@dataclasses.dataclass(kw_only=True, slots=True)
class StageRun:
    """One curriculum stage as the trainer runs it. ``name`` is the stage folder under the run's data folder."""

    name: str
    seq_len: int
    micro_batch: int = 1
    token_budget: int  # tokens to train on in this stage (optimizer steps × tokens_per_step)
    # None: the run's `activation_checkpointing`. Recomputing every layer in the backward costs about a third more
    # compute; a short stage whose activations fit can turn it off or recompute only its first N layers, the long
    # ones need all of it (the 1M step does).
    activation_checkpointing: Recompute | None = None
    # The vision tower's blocks likewise (None: the model preset's). `small` recomputes all 12 for the 1M stage's
    # packs of images; at 8K each block left out cost 1.2 GiB per 65,536-token micro-batch of the demo corpus and
    # saved 0.07 s of a 16-micro-batch step on an H100 (2026-12-06), as much per GiB as a decoder layer.
    vision_checkpointing: Recompute | None = None
    # The MoE layers not recomputed keep their routed rows from the forward for the backward
    # (``ModelConfig.keep_routed_rows``): 512 MiB more per layer and 65,536 tokens in `small`, one gather fewer.
    keep_routed_rows: bool = False

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and bool(self.name), "stages[].name", f"must be a non-empty str, got {self.name!r}")
        _positive(f"stages[{self.name}]", self, "seq_len", "micro_batch", "token_budget")
        _require(isinstance(self.keep_routed_rows, bool), f"stages[{self.name}].keep_routed_rows",
                 f"must be true or false, got {self.keep_routed_rows!r}")
        for field in ("activation_checkpointing", "vision_checkpointing"):
            value = getattr(self, field)
            _require(value is None or _is_recompute(value), f"stages[{self.name}].{field}",
                     f"must be true, false, a number of layers or absent, got {value!r}")


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainConfig:
    model: str = "tiny"  # preset name in trainer.model.config.PRESETS
    data: str  # output folder of `longweave pack`: one sub-folder per stage with its manifest
    stages: tuple[StageRun, ...]
    tokens_per_step: int
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    decay_fraction: float = 0.2  # WSD: the last fraction of all steps decays linearly to min_lr
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    zero_stage: int = 1
    bf16: bool = True
    activation_checkpointing: Recompute = False
    # The KDA kernels' chunk, 32 or 64 tokens (None: the preset's, ``KDAConfig.chunk_size``): the same model and
    # numbers to rounding, a speed setting (``devrun/README.md``).
    kda_chunk: int | None = None
    seed: int = 0
    num_workers: int = 2
    bad_sample_policy: str = "skip"
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    log_every: int = 1
    auto_advance: bool = True  # move to the next stage by itself once a stage's budget is spent
    # False only for benchmark runs: no checkpoint is written (periodic, at a stage transition, or at the end), so the
    # run cannot resume and `longweave stage advance` refuses it; the trainer's own stage advances still happen.
    save_checkpoints: bool = True
    # Optimizer steps in a row with a non-finite gradient norm (DeepSpeed skips their update) before the trainer
    # stops with an error; 0: at the first. In bf16 there is no loss scale to back off, so one is already a bug or a
    # divergence, and every further step would burn a full step of compute for nothing (Megatron-LM stops too).
    max_nonfinite_steps: int = 0
    # 0: off. Otherwise the optimizer step (counted over the run) that rank 0 runs under torch.profiler, engine and
    # loader included, writing `profile-step{N}.txt` to the run folder: what the model-only profiler
    # (`python -m trainer.model.profile`) cannot see, such as the engine's hooks and the queue drains between
    # micro-batches.
    profile_step: int = 0

    def __post_init__(self) -> None:
        _require(isinstance(self.data, str) and bool(self.data), "data", "must be the pack output folder")
        if isinstance(self.stages, list):
            self.stages = tuple(self.stages)
        _require(len(self.stages) > 0, "stages", "needs at least one stage")
        names = [s.name for s in self.stages]
        _require(len(set(names)) == len(names), "stages", f"duplicate stage names {names}")
        _positive("TrainConfig", self, "tokens_per_step", "checkpoint_every", "keep_checkpoints", "log_every")
        for name in ("warmup_steps", "max_nonfinite_steps", "profile_step"):
            _require(isinstance(getattr(self, name), int) and getattr(self, name) >= 0, name, "must be an int >= 0")
        _require(0.0 <= self.decay_fraction <= 1.0, "decay_fraction", f"must lie in [0, 1], got {self.decay_fraction}")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", f"must lie in [0, 1], got {self.min_lr_ratio}")
        _require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        _require(_is_recompute(self.activation_checkpointing), "activation_checkpointing",
                 f"must be true, false or a number of layers, got {self.activation_checkpointing!r}")
        for name in ("bf16", "auto_advance", "save_checkpoints"):
            _require(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")
        _require(self.kda_chunk in (None, 32, 64), "kda_chunk", f"must be 32, 64 or absent, got {self.kda_chunk!r}")
        _require(self.zero_stage in (0, 1, 2), "zero_stage", f"must be 0, 1 or 2, got {self.zero_stage}")
        _require(self.bad_sample_policy in ("fail", "skip"), "bad_sample_policy",
                 f"must be 'fail' or 'skip', got {self.bad_sample_policy!r}")
        for stage in self.stages:
            _require(stage.token_budget % self.tokens_per_step == 0, f"stages[{stage.name}].token_budget",
                     f"{stage.token_budget} is not a whole number of steps of {self.tokens_per_step} tokens")

    def grad_accum(self, stage: StageRun, world_size: int) -> int:
        """Micro-batches per optimizer step that keep ``tokens_per_step`` constant in this stage."""
        per_micro = stage.micro_batch * stage.seq_len * world_size
        _require(self.tokens_per_step % per_micro == 0, f"stages[{stage.name}]",
                 f"tokens_per_step {self.tokens_per_step} is not a multiple of micro_batch {stage.micro_batch} × "
                 f"seq_len {stage.seq_len} × world size {world_size}")
        return self.tokens_per_step // per_micro

    def checkpointing(self, stage: StageRun) -> Recompute:
        """Which layers this stage recomputes in the backward: its own setting, else the run's."""
        return self.activation_checkpointing if stage.activation_checkpointing is None else stage.activation_checkpointing

    def vision_checkpointing(self, stage: StageRun) -> Recompute:
        """Which vision-tower blocks this stage recomputes in the backward: its own setting, else the model
        preset's."""
        if stage.vision_checkpointing is not None:
            return stage.vision_checkpointing
        from trainer.model.config import preset  # here: the model package loads torch, which parsing a config need not
        return preset(self.model).vision.checkpoint_layers

    def steps_in(self, stage: StageRun) -> int:
        return stage.token_budget // self.tokens_per_step

    @property
    def total_steps(self) -> int:
        return sum(self.steps_in(s) for s in self.stages)

    def stage(self, name: str) -> StageRun:
        for s in self.stages:
            if s.name == name:
                return s
        raise ValueError(f"stage {name!r} is not in this run's curriculum ({', '.join(s.name for s in self.stages)})")

    def stage_index(self, name: str) -> int:
        return [s.name for s in self.stages].index(self.stage(name).name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        _require(not unknown, unknown[0] if unknown else "", "unknown config key")
        stages = data.get("stages")
        _require(isinstance(stages, (list, tuple)) and bool(stages), "stages", "must be a non-empty list")
        try:
            parsed = tuple(StageRun(**s) for s in stages)
        except TypeError as exc:
            raise ValueError(f"stages: {exc}") from None
        values = {**data, "stages": parsed}
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        return cls(**values)


def load_train_config(path: str | Path) -> TrainConfig:
    """A YAML file mapping onto :class:`TrainConfig` (``stages`` a list of :class:`StageRun` mappings)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    _require(isinstance(data, Mapping), str(path), "must hold a mapping")
    return TrainConfig.from_dict(data)
