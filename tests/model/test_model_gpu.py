"""``small`` on one GPU in bf16: a full forward + backward at the 8K and 64K stages (Triton KDA, FlexAttention MLA
and vision, grouped-GEMM MoE, activation checkpointing). Prints tokens/s, peak memory and MFU for BENCHMARKS.md."""
from __future__ import annotations

import math

import pytest
import torch

from trainer.model import LongweaveModel, preset
from trainer.model.flops import mfu, training_flops
from trainer.model.synthetic import IMAGE_GRIDS, synthetic_batch
from trainer.model.timing import timed_forward_backward


@pytest.fixture(scope="module")
def model() -> LongweaveModel:
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LongweaveModel(preset("small")).to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [8192, 65536], ids=["8k", "64k"])
def test_small_forward_backward_bf16(model: LongweaveModel, seq_len: int) -> None:
    generator = torch.Generator().manual_seed(seq_len)
    batch, doc_lengths = synthetic_batch(seq_len, generator)
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(3):  # the first step compiles (Triton, FlexAttention); the others are timed
        seconds, out = timed_forward_backward(model, lambda: batch)
        times.append(seconds)
    loss = out.loss.item()
    assert math.isfinite(loss) and abs(loss - math.log(32768)) < 2.0, loss
    for name in ("vision.patch_embed.weight", "decoder.layers.0.mixer.q_proj.weight",
                 "decoder.layers.3.mixer.kv_down.weight", "decoder.layers.5.ffn.w13", "lm_head.weight"):
        grad = model.get_parameter(name).grad
        assert grad is not None and bool(torch.isfinite(grad).all()) and bool(grad.abs().sum() > 0), name
    step = min(times[1:])
    flops = training_flops(model.config, doc_lengths, IMAGE_GRIDS, n_loss_tokens=out.n_loss_tokens)
    print(f"\nsmall bf16 seq_len={seq_len}: first step {times[0]:.1f}s, step {step * 1e3:.0f} ms, "
          f"{seq_len / step:,.0f} tokens/s, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB, "
          f"MFU {mfu(flops.total, step):.1%}, loss {loss:.3f}, docs {len(doc_lengths)}")


@pytest.mark.gpu
def test_a_step_given_the_trainers_batch_reads_nothing_back(model: LongweaveModel) -> None:
    """The batch split as the trainer passes it (metadata on the host, patches on the device): a warm forward +
    backward makes no host-device sync. Each one would wait for all queued work, at a micro-batch's start the whole
    previous backward, and leave the GPU idle while the host launches again."""
    batch, _ = synthetic_batch(8192, torch.Generator().manual_seed(1))
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    model(**batch).loss.backward()  # compiles and autotunes
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = model(**batch)
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(out.loss.item())
