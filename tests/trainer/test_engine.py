"""The trainer's engine: its host-thread policy (``trainer.engine.one_host_thread``), DeepSpeed's throughput timer
off, how it sums the gradients of a step's micro-batches in bf16, and that a bf16 engine resumes from its checkpoint.
The engine tests run their code in a process of its own: DeepSpeed's process group."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.engine import one_host_thread


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_one_host_thread_on_cuda_unless_omp_num_threads_is_set(threads, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    one_host_thread(torch.device("cpu"))  # the CPU path trains on the host: its threads stay
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    one_host_thread(torch.device("cuda"))  # the user's setting wins
    assert torch.get_num_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    one_host_thread(torch.device("cuda"))
    assert torch.get_num_threads() == 1


def run_alone(code: str) -> str:
    """The last line ``code`` prints, run by a fresh interpreter at the repository root (which must succeed)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_engine_leaves_the_device_queue_alone() -> None:
    """The engine the trainer builds has DeepSpeed's throughput timer off: on a GPU it synchronises the device at
    every micro-batch's forward and every engine.step(), draining the launch queue."""
    code = ("import torch\n"
            "from trainer.engine import build_engine, deepspeed_config, init_distributed\n"
            "init_distributed()\n"
            "engine = build_engine(torch.nn.Linear(8, 8), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0,\n"
            "                      schedule=lambda step: 1.0, ds_config=deepspeed_config(\n"
            "                          micro_batch=1, grad_accum=2, bf16=False, zero_stage=1, grad_clip=1.0))\n"
            "print('throughput timer enabled:', engine.tput_timer.config.enabled)\n")
    assert run_alone(code) == "throughput timer enabled: False"


# The first micro-batch's inputs are 100 times the others', so a running sum rounded to bf16 (8 bits of mantissa)
# loses most of the later ones' digits.
ACCUMULATION = """
import json, torch
from trainer.engine import build_engine, deepspeed_config, init_distributed
init_distributed()
torch.manual_seed(0)
model = torch.nn.Linear(64, 1, bias=False)
twin = torch.nn.Linear(64, 1, bias=False).to(torch.bfloat16)
twin.load_state_dict(model.state_dict())
engine = build_engine(model, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, schedule=lambda step: 1.0,
                      ds_config=deepspeed_config(micro_batch=1, grad_accum=16, bf16=True, zero_stage=1,
                                                 grad_clip=0.0))
exact, rounded = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
for i in range(16):
    x = (torch.randn(1, 64) * (100.0 if i == 0 else 1.0)).to(torch.bfloat16)
    engine.backward(engine(x).float().sum())
    twin.zero_grad()
    (twin(x).float().sum() / 16).backward()
    exact += twin.weight.grad.float()[0]
    rounded += twin.weight.grad[0]
    if i < 15:
        engine.step()  # not yet a boundary: accumulates
summed = engine.optimizer.fp32_groups_gradients_flat[0][:64].float()
errors = {name: ((other.float() - summed).norm() / exact.norm()).item()
          for name, other in (("exact", exact), ("rounded", rounded))}
print(json.dumps({**errors, "adder": engine.optimizer._update_hp_grad.__qualname__}))
"""


def test_bf16_micro_batches_sum_in_float32() -> None:
    """With bf16 on, a step's 16 micro-batch gradients (each bf16, as autograd gives them) are summed in float32 up to
    the optimizer, the boundary's all-reduce included: DeepSpeed's defaults sum in bf16 (and cast the sum to bf16 to
    all-reduce it): 6.1e-3 off here, as the bf16 running sum the test keeps beside. The CPU accelerator runs the same
    BF16_Optimizer as a GPU, and the trainer's one-pass add of each gradient into its sum."""
    errors = json.loads(run_alone(ACCUMULATION))
    assert errors["exact"] < 1e-6 and errors["rounded"] > 1e-4, errors
    # through the trainer's one-pass add, not DeepSpeed's copy-then-add
    assert errors["adder"] == "_sum_grads_in_one_pass.<locals>.update_hp_grad", errors


RESUME = """
import json, tempfile, torch
from trainer.engine import build_engine, deepspeed_config, init_distributed
init_distributed()

def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    return build_engine(model, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, schedule=lambda step: 1.0,
                        ds_config=deepspeed_config(micro_batch=2, grad_accum=2, bf16=True, zero_stage=1,
                                                   grad_clip=1.0))

def train(engine, steps, seed):
    inputs = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(2 * steps):
        loss = engine(torch.randn(2, 8, generator=inputs).to(torch.bfloat16)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses

first = make()
train(first, 2, seed=1)
folder = tempfile.mkdtemp()
first.save_checkpoint(folder, tag="t")
resumed = make()
resumed.load_checkpoint(folder, tag="t", load_optimizer_states=True, load_lr_scheduler_states=True)
print(json.dumps({"optimizer": type(resumed.optimizer).__name__,
                  "checkpoint_engine": type(resumed.checkpoint_engine).__name__,
                  "uninterrupted": train(first, 2, seed=2), "resumed": train(resumed, 2, seed=2)}))
"""


def test_bf16_engine_resumes_from_its_checkpoint() -> None:
    """A bf16 engine (DeepSpeed's BF16_Optimizer, what a GPU run trains with) saved after two steps and loaded by
    a fresh one through the pickle-free checkpoint engine continues with the same losses as the run it came from:
    the float32 master weights, the Adam moments and the schedule all came back."""
    result = json.loads(run_alone(RESUME))
    assert result["optimizer"] == "BF16_Optimizer" and result["checkpoint_engine"] == "SafeTorchCheckpointEngine"
    assert result["resumed"] == result["uninterrupted"] and len(set(result["resumed"])) == 4, result
