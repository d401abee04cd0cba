"""Where a training step of the model spends its time: ``torch.profiler`` over forward + backward on one GPU.

    python -m trainer.model.profile --preset small --seq-len 8192 [--steps 2] [--rows 40]

Prints step time, tokens/s and MFU, the operators by self GPU time and by self CPU time, and the host-device
synchronisations and device-to-host copies (each one stalls the launch queue), so the next optimisation targets a
measured hot spot. When the CPU time per step exceeds the GPU time, the step is host-bound (launches, Python).
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from trainer.model import LongweaveModel, preset
from trainer.model.flops import mfu, training_flops
from trainer.model.synthetic import IMAGE_GRIDS, synthetic_batch
from trainer.model.timing import timed_forward_backward

# What stalls the launch queue: explicit synchronisations and device-to-host copies. `aten::item` is not listed: most
# of a step's calls read host tensors (block masks, chunk tables), 191 of them at 32K against 4 stream syncs.
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "Memcpy DtoH (Device -> Pageable)",
            "Memcpy DtoH (Device -> Pinned)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=2, help="profiled steps after two warm-up steps")
    parser.add_argument("--rows", type=int, default=40)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LongweaveModel(preset(args.preset)).to(torch.bfloat16)
    batch, doc_lengths = synthetic_batch(args.seq_len, torch.Generator().manual_seed(0))
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)

    def step() -> float:
        return timed_forward_backward(model, lambda: batch)[0]

    warm = [step() for _ in range(2)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        times = [step() for _ in range(args.steps)]
    plain = min(step() for _ in range(2))  # the profiler's own overhead excluded
    with torch.no_grad():
        n_loss = model(**batch).n_loss_tokens
    flops = training_flops(model.config, doc_lengths, IMAGE_GRIDS, n_loss_tokens=n_loss)
    print(f"{args.preset} seq_len={args.seq_len}: warm-up {[round(t, 2) for t in warm]} s, profiled "
          f"{[round(t, 3) for t in times]} s, plain step {plain * 1e3:.0f} ms, {args.seq_len / plain:,.0f} tokens/s, "
          f"MFU {mfu(flops.total, plain):.1%}, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    events = prof.key_averages()
    print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows // 2, max_name_column_width=70))
    print("host-device synchronisations per step:")
    for e in events:
        if e.key in SYNC_OPS:
            print(f"  {e.key:30s} {e.count / args.steps:8.1f} calls, {e.cpu_time_total / args.steps / 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
