"""``small`` on one GPU in bf16: a full forward + backward at the 8K and 64K stages (Triton KDA, FlexAttention MLA
and vision, grouped-GEMM MoE, activation checkpointing). Prints tokens/s, peak memory and MFU for BENCHMARKS.md."""
from __future__ import annotations

import math
import time

import pytest
import torch

from tokenization import load_tokenizer
from trainer.model import LongweaveModel, flatten_cu_seqlens, preset, text_labels
from trainer.model.flops import mfu, training_flops

SPECIAL = load_tokenizer().special
IMAGE_GRIDS = [(16, 16), (12, 20)]


@pytest.fixture(scope="module")
def model() -> LongweaveModel:
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LongweaveModel(preset("small")).to(torch.bfloat16)


def _batch(seq_len: int, generator: torch.Generator, device: str = "cuda") -> tuple[dict, list[int]]:
    """One row: a 2048-token document holding two images, random-length documents after it, a padding tail.
    Returns the batch and the segment lengths (padding included) for the FLOP count."""
    lengths = [2048]
    while sum(lengths) < seq_len - 600:
        n = 64 + int(torch.empty(()).log_normal_(7.0, 1.0, generator=generator))
        lengths.append(min(n, seq_len - 100 - sum(lengths)))
    used = sum(lengths)
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    ids = torch.randint(6, 32768, (seq_len,), generator=generator)
    ids[used:] = SPECIAL.pad
    at = 8
    for rows, cols in IMAGE_GRIDS:
        ids[at], ids[at + 1:at + 1 + rows * cols], ids[at + 1 + rows * cols] = (
            SPECIAL.image_start, SPECIAL.image_pad, SPECIAL.image_end)
        at += rows * cols + 10
    labels = torch.from_numpy(text_labels(ids.numpy().astype("uint32"), cu, SPECIAL))
    patches = sum(4 * r * c for r, c in IMAGE_GRIDS)
    batch = {
        "input_ids": ids[None],
        "labels": labels[None],
        "cu_seqlens": flatten_cu_seqlens([cu], seq_len),
        "pixel_values": torch.randn(patches, 588, generator=generator),
        "image_grid": torch.tensor(IMAGE_GRIDS),
    }
    return {k: v.to(device) for k, v in batch.items()}, lengths + [seq_len - used]


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [8192, 65536], ids=["8k", "64k"])
def test_small_forward_backward_bf16(model: LongweaveModel, seq_len: int) -> None:
    generator = torch.Generator().manual_seed(seq_len)
    batch, doc_lengths = _batch(seq_len, generator)
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(3):  # the first step compiles (Triton, FlexAttention); the others are timed
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(**batch)
        out.loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
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
