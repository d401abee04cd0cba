"""The training loop: stage loader → model → DeepSpeed engine, with checkpoints, metrics and stage transitions.

``longweave train --run DIR --config CONFIG.yaml`` in one process, or ``deepspeed --num_gpus N -m trainer.train
--run DIR --config CONFIG.yaml`` for several. A run folder that already holds a config resumes from its newest
complete checkpoint: model, optimizer, schedule, loader position and curriculum are restored exactly.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kernels import tuning_picks
from kernels.moe import step_moe_balance
from trainer.config import TrainConfig, load_train_config, recompute_label
from trainer.curriculum import StageError, advance, check_fingerprints, plan_stage, stage_manifest
from trainer.data.loader import build_loader
from trainer.engine import build_engine, deepspeed_config, init_distributed, one_host_thread, set_stage_batch
from trainer.metrics import MetricsWriter, truncate_metrics
from trainer.model.config import preset
from trainer.model.flops import mfu, training_flops
from trainer.model.multimodal import LongweaveModel
from trainer.run_dir import TRAINER_STATE, RunDir, write_json_atomic
from trainer.schedule import wsd_factor

__all__ = ["Trainer", "TrainerState", "batch_shapes", "main", "model_inputs", "register"]
log = logging.getLogger(__name__)

_MODEL_INPUTS = ("input_ids", "labels", "cu_seqlens", "pixel_values", "image_grid")
# What the model reads on the host (token ids for the image check, labels for their count, boundaries, image grids)
# stays there: read back from the device, it would wait for the previous micro-batch's backward to leave the GPU
# queue. The model moves what the GPU needs.
_HOST_INPUTS = ("input_ids", "labels", "cu_seqlens", "image_grid")


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainerState:
    """Where the run stands; saved beside every checkpoint as JSON."""

    step: int = 0  # optimizer steps over the whole run
    stage: str
    stage_step: int = 0
    tokens: int = 0
    stage_tokens: int = 0
    nonfinite_steps: int = 0  # optimizer steps in a row whose gradient norm was inf or NaN (their update skipped)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def model_inputs(batch: dict[str, Any], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The model's arguments from a loader batch: image patches on ``device`` in ``dtype``; the rest left on the host
    (``_HOST_INPUTS``)."""
    inputs = {k: batch[k].to(device, non_blocking=True)
              if isinstance(batch[k], torch.Tensor) and k not in _HOST_INPUTS else batch[k] for k in _MODEL_INPUTS}
    if inputs["pixel_values"] is not None:
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    return {**inputs, "sample_keys": batch["sample_keys"]}


def batch_shapes(batch: dict[str, Any]) -> tuple[list[int], list[tuple[int, int]]]:
    """Segment lengths (padding included) and merged image grids of a loader batch: what the FLOP count needs."""
    lengths = torch.diff(batch["cu_seqlens"]).tolist()
    grids = [tuple(g) for g in batch["image_grid"].tolist()] if batch["image_grid"] is not None else []
    return lengths, grids


def _open_run(run: RunDir, config_path: Path | None, rank: int) -> TrainConfig:
    """The run's config: written (by rank 0) at the first start; on resume a different --config is refused."""
    if rank != 0:
        return load_train_config(config_path) if config_path is not None else run.load_config()
    if run.config_path.is_file():
        config = run.load_config()
        if config_path is not None and load_train_config(config_path).fingerprint() != config.fingerprint():
            raise SystemExit(f"--config {config_path}: differs from the config {run.root} was started with; "
                             "start a new run folder instead")
        if not config.save_checkpoints:
            raise SystemExit(f"--run {run.root}: this run writes no checkpoints (save_checkpoints: false), so it "
                             "cannot resume; start a new run folder")
        return config
    if config_path is None:
        raise SystemExit(f"--run {run.root}: not a run yet; pass --config to start one")
    config = load_train_config(config_path)
    run.root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run.config_path, config.to_dict())
    return config


class Trainer:
    def __init__(self, run: RunDir, config: TrainConfig) -> None:
        self.started = time.perf_counter()
        self.run, self.config = run, config
        self.rank, self.world_size, _ = init_distributed()
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.bf16 = config.bf16 and torch.cuda.is_available()  # the CPU path trains in fp32
        one_host_thread(self.device)
        first = config.stages[0]
        if self.rank == 0 and not run.fingerprints_path.is_file():
            manifest = stage_manifest(config, first)
            write_json_atomic(run.fingerprints_path, {"tokenizer": manifest.tokenizer_fingerprint,
                                                      "vision": manifest.vision_fingerprint})
        self._barrier()
        torch.manual_seed(config.seed)
        model_config = dataclasses.replace(preset(config.model), checkpoint_layers=config.activation_checkpointing)
        if config.kda_chunk is not None:
            model_config.kda.chunk_size = config.kda_chunk
        self.model_config = model_config
        model = LongweaveModel(model_config)
        schedule = functools.partial(wsd_factor, total_steps=config.total_steps, warmup_steps=config.warmup_steps,
                                     decay_fraction=config.decay_fraction, min_ratio=config.min_lr_ratio)
        self.state = TrainerState(stage=run.current_stage(config))
        stage = config.stage(self.state.stage)
        self.engine = build_engine(model, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay,
                                   schedule=schedule, ds_config=deepspeed_config(
                                       micro_batch=stage.micro_batch, grad_accum=config.grad_accum(stage, self.world_size),
                                       bf16=self.bf16, zero_stage=config.zero_stage, grad_clip=config.grad_clip))
        loader_state = self._resume()
        self._enter_stage(self.state.stage, loader_state)
        self.metrics = MetricsWriter(run.metrics_path, run.tensorboard, enabled=self.rank == 0)

    def _barrier(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def _resume(self) -> dict[str, Any] | None:
        checkpoint = self.run.latest_checkpoint()
        if checkpoint is None:
            return None
        saved = self.run.trainer_state(checkpoint)
        self.engine.load_checkpoint(str(self.run.checkpoints), tag=checkpoint.name,
                                    load_optimizer_states=True, load_lr_scheduler_states=True)
        state = TrainerState(**saved["trainer"])
        if self.rank == 0:
            truncate_metrics(self.run.metrics_path, state.step)
        log.info("resumed %s at step %d (stage %s)", checkpoint, state.step, state.stage)
        current = self.run.current_stage(self.config)
        if current != state.stage:  # `longweave stage advance` moved the run: the new stage starts fresh
            self.state = TrainerState(step=state.step, stage=current, tokens=state.tokens)
            return None
        self.state = state
        return saved["loader"]

    def _enter_stage(self, name: str, loader_state: dict[str, Any] | None) -> None:
        config, stage = self.config, self.config.stage(name)
        manifest = stage_manifest(config, stage)
        check_fingerprints(manifest, self.run.fingerprints(), f"stage {name!r}")
        self.plan = plan_stage(config, stage, self.world_size)
        set_stage_batch(self.engine, stage.micro_batch, self.plan.grad_accum, self.world_size)
        self.model_config.checkpoint_layers = self.plan.activation_checkpointing   # the decoder reads it per forward
        self.model_config.vision.checkpoint_layers = self.plan.vision_checkpointing
        self.model_config.keep_routed_rows = self.plan.keep_routed_rows
        for field, owner in (("activation_checkpointing", self.model_config),
                             ("vision_checkpointing", self.model_config.vision)):
            try:
                owner.recomputed_layers()
            except ValueError as err:
                raise ValueError(f"stages[{name}].{field}: {err}") from None
        self.loader = build_loader(Path(config.data) / name, rank=self.rank, world_size=self.world_size,
                                   num_workers=config.num_workers, seed=config.seed, micro_batch=stage.micro_batch,
                                   policy=config.bad_sample_policy)
        if loader_state is not None:
            self.loader.load_state_dict(loader_state)
        self.batches: Iterator[dict[str, Any]] = iter(self.loader)
        log.info("stage %s: seq_len %d, micro_batch %d, grad_accum %d, %d steps, activation checkpointing %s "
                 "(vision tower: %s)%s", name, stage.seq_len, stage.micro_batch, self.plan.grad_accum, self.plan.steps,
                 recompute_label(self.plan.activation_checkpointing),
                 recompute_label(self.plan.vision_checkpointing),
                 ", the MoE layers' routed rows kept" if self.plan.keep_routed_rows else "")

    def save_checkpoint(self) -> Path:
        tag = f"step-{self.state.step:08d}"
        self.engine.save_checkpoint(str(self.run.checkpoints), tag=tag)
        folder = self.run.checkpoints / tag
        if self.rank == 0:
            write_json_atomic(folder / TRAINER_STATE, {"trainer": self.state.to_dict(),
                                                       "loader": self.loader.state_dict(),
                                                       "config_fingerprint": self.config.fingerprint(),
                                                       "fingerprints": self.run.fingerprints()})
            for old in self.run.complete_checkpoints()[:-self.config.keep_checkpoints]:
                shutil.rmtree(old)
        self._barrier()
        return folder

    def _micro_step(self, batch: dict[str, Any]) -> tuple[torch.Tensor, int, list[int], list[tuple[int, int]]]:
        """Forward and backward of one micro-batch; its loss sum stays on the device (read once per step)."""
        out = self.engine(**model_inputs(batch, self.device, torch.bfloat16 if self.bf16 else torch.float32))
        self.engine.backward(out.loss)
        self.engine.step()
        lengths, grids = batch_shapes(batch)
        return out.loss_sum.detach(), out.n_loss_tokens, lengths, grids

    def train_step(self) -> dict[str, Any]:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()  # peak_memory_gib is this step's
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        start = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        n_loss, lengths, grids, keys = 0, [], [], []
        for _ in range(self.plan.grad_accum):
            batch = next(self.batches)
            keys.extend(batch["sample_keys"])
            s, n, l, g = self._micro_step(batch)
            loss_sum, n_loss = loss_sum + s, n_loss + n
            lengths += l
            grids += g
        totals = torch.tensor([float(loss_sum), float(n_loss)], dtype=torch.float64)
        if self.world_size > 1:
            torch.distributed.all_reduce(totals)
            per_rank: list[list[str]] = [[] for _ in range(self.world_size)]
            torch.distributed.all_gather_object(per_rank, keys)
            keys = [key for rank_keys in per_rank for key in rank_keys]
        stats = [s.as_dict() for s in step_moe_balance(self.engine.module)]
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        self.state.step += 1
        self.state.stage_step += 1
        self.state.tokens += self.config.tokens_per_step
        self.state.stage_tokens += self.config.tokens_per_step
        flops = training_flops(self.model_config, lengths, grids, n_loss).total * self.world_size
        grad_norm = float(self.engine.get_global_grad_norm() or 0.0)
        self.state.nonfinite_steps = 0 if math.isfinite(grad_norm) else self.state.nonfinite_steps + 1
        record = {
            "step": self.state.step,
            "stage": self.state.stage,
            "seq_len": self.plan.seq_len,
            "micro_batch": self.plan.micro_batch,
            "grad_accum": self.plan.grad_accum,
            "activation_checkpointing": self.model_config.checkpoint_layers,   # as the decoder ran it
            "vision_checkpointing": self.model_config.vision.checkpoint_layers,
            "kda_chunk": self.model_config.kda.chunk_size,   # the KDA kernels' chunk, which the FLOP count follows
            "loss": float(totals[0] / max(totals[1], 1)),
            "lr": self.engine.lr_scheduler.get_last_lr()[0],
            "grad_norm": grad_norm,
            "nonfinite_steps": self.state.nonfinite_steps,
            "tokens": self.state.tokens,
            "tokens_per_s": self.config.tokens_per_step / seconds,
            "mfu": mfu(flops, seconds, self.world_size) if self.device.type == "cuda" else None,
            "expert_max_over_mean": max((s["max_over_mean"] for s in stats), default=None),
            "expert_cv": sum(s["cv"] for s in stats) / len(stats) if stats else None,
            "step_seconds": seconds,
            "process_seconds": time.perf_counter() - self.started,  # since this process built the trainer
            "skipped_samples": self.loader.skipped,
            "sample_keys": keys,  # every rank's, rank by rank
        }
        if self.device.type == "cuda":
            record["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            # Allocations that found no free block: the allocator then synchronises the device and returns its cache
            # to the driver, stalling the step (torchtitan logs the same counter). Near the memory limit, a sign to
            # recompute more layers.
            record["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
        return record

    def _check_finite(self, record: dict[str, Any]) -> None:
        """Warn at a step whose gradient norm is not finite; stop once more than ``max_nonfinite_steps`` in a row."""
        if not record["nonfinite_steps"]:
            return
        where = (f"step {record['step']} ({record['stage']}): gradient norm {record['grad_norm']}, update skipped; "
                 f"samples {record['sample_keys']}")
        if self.rank == 0:
            log.warning(where)
        if self.state.nonfinite_steps > self.config.max_nonfinite_steps:
            raise SystemExit(
                f"{where}: {self.state.nonfinite_steps} non-finite step(s) in a row, more than max_nonfinite_steps="
                f"{self.config.max_nonfinite_steps}. Locate it with: python -m trainer.model.finite_check "
                f"{self.config.data} --stage {record['stage']} --preset {self.config.model}")

    def train(self, max_steps: int | None = None) -> TrainerState:
        """Train until the curriculum is done, or for ``max_steps`` more optimizer steps."""
        from rich.progress import Progress

        done_here = 0
        with Progress(disable=self.rank != 0, transient=True) as progress:
            task = progress.add_task("training", total=self.config.total_steps, completed=self.state.step)
            while max_steps is None or done_here < max_steps:
                if self.state.stage_step >= self.plan.steps:
                    if not self._advance_by_itself():
                        break
                    continue
                record = self._profiled_step() if self.state.step + 1 == self.config.profile_step else self.train_step()
                done_here += 1
                self._log_tuning()
                if self.state.step % self.config.log_every == 0:
                    self.metrics.write(record)
                    if self.rank == 0:
                        log.info("step %d (%s): %.2f s, %.0f tokens/s, MFU %s, peak %s GiB (%s allocation retries), "
                                 "loss %.4f", record["step"], record["stage"], record["step_seconds"],
                                 record["tokens_per_s"], f"{record['mfu']:.2%}" if record["mfu"] is not None else "-",
                                 f"{record['peak_memory_gib']:.1f}" if "peak_memory_gib" in record else "-",
                                 record.get("alloc_retries", "-"), record["loss"])
                progress.update(task, completed=self.state.step,
                                description=f"{self.state.stage} loss {record['loss']:.3f}")
                self._check_finite(record)
                if self.config.save_checkpoints and self.state.step % self.config.checkpoint_every == 0:
                    self.save_checkpoint()
        if self.config.save_checkpoints:
            latest = self.run.latest_checkpoint()
            if latest is None or self.run.trainer_state(latest)["trainer"]["step"] != self.state.step:
                self.save_checkpoint()
        self.metrics.close()
        return self.state

    def _log_tuning(self) -> None:
        """Name the Triton kernels the step left to the autotuner (no committed pick for this GPU), once each."""
        timed = tuning_picks.drain_timed()
        if timed and self.rank == 0:
            kernels = ", ".join(f"{name} ×{n}" for name, n in sorted(timed.items()))
            log.info("autotuned %d kernel key(s) with no committed pick for this GPU (%s; timed, or read from "
                     "Triton's cache); to commit their picks: %s",
                     timed.total(), kernels, tuning_picks.record_command())

    def _profiled_step(self) -> dict[str, Any]:
        """``train_step`` under torch.profiler on rank 0; the summary goes to ``profile-step{N}.txt``, every GPU
        kernel to ``profile-step{N}.csv``. Python frames are recorded (``with_stack``) so that each of the GPU's idle
        gaps names the code the host was in; that slows the host, so the profiled step's time is not the step's."""
        if self.rank != 0:
            return self.train_step()
        from torch.profiler import ProfilerActivity, profile

        from trainer.model.profile import summary, write_kernel_csv

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities, with_stack=True) as prof:
            record = self.train_step()
        path = self.run.root / f"profile-step{record['step']}.txt"
        path.write_text(f"step {record['step']} ({record['stage']}): {record['step_seconds']:.3f} s under the "
                        f"profiler, {self.plan.grad_accum} micro-batches\n" + summary(prof, steps=1, rows=40) + "\n")
        write_kernel_csv(path.with_suffix(".csv"), prof, steps=1)  # header only without CUDA kernels
        log.info("profile of step %d written to %s", record["step"], path)
        return record

    def _advance_by_itself(self) -> bool:
        """At a spent stage budget: with ``auto_advance``, checkpoint (unless the run writes none) and move to the
        next stage."""
        index = self.config.stage_index(self.state.stage)
        if not self.config.auto_advance or index + 1 >= len(self.config.stages):
            return False
        if self.config.save_checkpoints:
            self.save_checkpoint()
        if self.rank == 0:
            advance(self.run, self.config, self.world_size,
                    state=None if self.config.save_checkpoints else self.state.to_dict())
        self._barrier()
        self.state = TrainerState(step=self.state.step, stage=self.run.current_stage(self.config), tokens=self.state.tokens)
        self._enter_stage(self.state.stage, None)
        return True


def _run(args: argparse.Namespace, _extra: list[str] | None = None) -> int:
    run = RunDir(args.run)
    config = _open_run(run, args.config, int(os.environ.get("RANK", "0")))
    try:
        trainer = Trainer(run, config)
        state = trainer.train(args.max_steps)
    except StageError as exc:
        raise SystemExit(str(exc)) from None
    if trainer.rank == 0:
        print(json.dumps({"run": str(run.root), **state.to_dict()}))
    return 0


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", type=Path, required=True, help="run folder (created, or resumed from)")
    parser.add_argument("--config", type=Path, default=None, help="YAML TrainConfig (needed to start a run)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="train on packed shards with DeepSpeed (resumes a run folder)")
    add_train_arguments(parser)
    parser.set_defaults(handler=_run)


def main(argv: list[str] | None = None) -> int:
    """Entry point under the ``deepspeed`` launcher (``-m trainer.train``), which adds ``--local_rank``."""
    parser = argparse.ArgumentParser(prog="trainer.train", description=__doc__.splitlines()[0])
    add_train_arguments(parser)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return _run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
