"""The DeepSpeed engine of a run: distributed set-up, the generated DeepSpeed config, optimizer, schedule, and a
checkpoint engine that loads with ``torch.load(weights_only=True)``.

One process without a launcher initialises a world of one (NCCL on CUDA, gloo on the CPU accelerator); under the
``deepspeed`` launcher the environment it sets is used as is.
"""
from __future__ import annotations

import atexit
import functools
import logging
import os
from typing import Any

import torch

from kernels.accumulate import add_into

__all__ = ["import_deepspeed", "init_distributed", "deepspeed_config", "build_engine", "set_stage_batch",
           "one_host_thread"]

log = logging.getLogger(__name__)


def one_host_thread(device: torch.device) -> None:
    """On CUDA, run this process's CPU ops on one thread unless ``OMP_NUM_THREADS`` says otherwise (torchrun's
    default too). The process only launches GPU work and reads host metadata, so its CPU ops are small; with a thread
    per core they contend with the loader's workers and each other: on the H200 machine every host op over an 8k
    micro-batch's ~100K image patches took 8 ms, and the GPU waited."""
    if device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def import_deepspeed():
    """Import DeepSpeed with the right accelerator; on CPU skip its JIT-built shared-memory all-reduce (a 1–3 minute
    C++ build that only speeds up multi-process CPU reductions; gloo does them)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    if not torch.cuda.is_available():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def init_distributed() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)``; a lone process becomes a world of one on a free local port."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    deepspeed = import_deepspeed()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    ours = not torch.distributed.is_initialized()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if ours:
        # At exit, not after each run: `longweave demo` trains twice in one process, and DeepSpeed keeps its groups
        # of the first process group. Without it NCCL warns of leaked resources when the process ends.
        atexit.register(_destroy_process_group)
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def _destroy_process_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def deepspeed_config(*, micro_batch: int, grad_accum: int, bf16: bool, zero_stage: int, grad_clip: float) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        # Gradients accumulate over the micro-batches in float32, as Megatron's main_grad and torchtitan's float32
        # reduction do. DeepSpeed's default with bf16 is to accumulate in the parameters' own bf16 .grad (16
        # micro-batches of the 8k stage: each add rounds the running sum to 8 bits of mantissa). Each parameter's
        # bf16 gradient is added into its float32 accumulator as soon as autograd has it, then freed, so no bf16
        # gradient stays allocated through the next micro-batch's forward.
        "bf16": {"enabled": bf16, "immediate_grad_update": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        # And are reduced across ranks in float32: DeepSpeed's default casts them to the model's bf16 to all-reduce
        # and back, which rounds the whole sum to bf16 at the last micro-batch, even on one GPU.
        "communication_data_type": "fp32",
        "zero_optimization": {"stage": zero_stage},
        "gradient_clipping": grad_clip,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        # The engine's throughput timer synchronises the device when each micro-batch's forward starts and at each
        # engine.step(): 18 device syncs per 8-micro-batch step, 1.67 s of a profiled 15.2 s step at 8K on the H200,
        # each draining the launch queue. The trainer times its steps itself.
        "timers": {"throughput": {"enabled": False}},
    }


@functools.cache
def _safe_checkpoint_engine_class():
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch engine, but loading refuses pickled code: ``weights_only=True`` with only the DeepSpeed
        classes its own state holds allowed (loss scaler, ZeRO stage enum, parameter fragment addresses)."""

        def load(self, path: str, map_location: Any = None) -> Any:
            with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
                return torch.load(path, map_location=map_location, weights_only=True)

    return SafeTorchCheckpointEngine


def build_engine(model: torch.nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float,
                 schedule: Any, ds_config: dict) -> Any:
    """DeepSpeed engine over ``model`` with AdamW (no decay on norms and biases) and a LambdaLR of ``schedule``.

    The optimizer is torch's own (fused on CUDA), handed to DeepSpeed as a client optimizer, so no DeepSpeed op
    is JIT-compiled on a machine that has never built one."""
    deepspeed = import_deepspeed()
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=betas, fused=torch.cuda.is_available(),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    engine.checkpoint_engine = _safe_checkpoint_engine_class()(engine._config)
    _sum_grads_in_one_pass(engine.optimizer)
    return engine


def _sum_grads_in_one_pass(optimizer: Any) -> None:
    """Each bf16 gradient added into its float32 sum by one kernel that casts as it reads (``kernels.accumulate``).

    DeepSpeed's ``BF16_Optimizer`` (0.19.8, ``_update_hp_grad``) adds ``lp.grad.to(float32)``: a float32 copy of
    every gradient, written and read again, 8 bytes a parameter per micro-batch beyond the add itself (``small``'s
    1.92 B parameters: 15 GB a micro-batch, about 4.6 ms at an H100's bandwidth, 16 or 32 times a step). PyTorch's
    ``add_`` of a bf16 tensor into a float32 one gives the same sum but runs unvectorised (134 ms a step on the H200);
    ``add_into`` is the same additions in 16-byte loads. Left to DeepSpeed where its expert folding applies
    (expert-parallel tensor groups, not used here) or on another optimizer."""
    if type(optimizer).__name__ != "BF16_Optimizer" or not getattr(optimizer, "immediate_grad_update", False):
        return
    deepspeeds = optimizer._update_hp_grad

    def update_hp_grad(lp: torch.nn.Parameter, group_idx: int, param_idx: int, clear_lp_grads: bool) -> None:
        if lp.grad is None or optimizer.autoep_folding_tp_group is not None:
            deepspeeds(lp, group_idx, param_idx, clear_lp_grads)
            return
        hp_grad = optimizer.fp32_groups_gradients[group_idx][param_idx]
        add_into(hp_grad, lp.grad)
        lp._hp_grad = hp_grad
        optimizer.fp32_groups_has_gradients[group_idx][param_idx] = True
        if clear_lp_grads:
            lp.grad.zero_()

    optimizer._update_hp_grad = update_hp_grad


def set_stage_batch(engine: Any, micro_batch: int, grad_accum: int, world_size: int) -> None:
    """Point the engine at a stage's micro-batch and accumulation (tokens per step stay the same)."""
    engine.set_train_micro_batch_size(micro_batch)
    engine.set_train_batch_size(micro_batch * grad_accum * world_size)
