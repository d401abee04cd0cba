"""Benchmark one micro-batch's float32 gradient sums: every parameter of ``small`` added into its float32 sum, by the
kernel and by PyTorch's in-place add, on one GPU.

    python -m kernels.accumulate.bench [--json out.json]

Times are medians of ``triton.testing.do_bench`` (CUDA events) over all the parameters' adds in a row, as the
trainer runs them (one launch each); bytes are 10 a parameter (the float32 sum read and written, the bf16 gradient
read).
"""
from __future__ import annotations

import argparse

import torch
import triton

from kernels.accumulate import add_into, naive_add_into
from kernels.benchmarking import append_json_lines


def parameter_sizes() -> list[int]:
    """The element count of each of ``small``'s parameters, from the model built on the meta device."""
    from trainer.model import LongweaveModel, small

    with torch.device("meta"):
        return [p.numel() for p in LongweaveModel(small()).parameters()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="append one JSON line per implementation here")
    args = parser.parse_args(argv)
    sizes = parameter_sizes()
    torch.manual_seed(0)
    sums = [torch.randn(n, device="cuda") for n in sizes]
    grads = [torch.randn(n, device="cuda").bfloat16() for n in sizes]
    total = sum(sizes)
    for acc, x in zip(sums, grads):   # they agree before either is timed
        assert torch.equal(add_into(acc.clone(), x), naive_add_into(acc.clone(), x))
    rows = []
    for name, fn in (("longweave", add_into), ("torch", naive_add_into)):
        ms = triton.testing.do_bench(lambda fn=fn: [fn(a, x) for a, x in zip(sums, grads)], return_mode="median")
        rows.append(dict(impl=name, params=total, tensors=len(sizes), ms=ms, TBps=10 * total / ms / 1e9))
    for r in rows:
        print(f"{r['impl']:>10} {r['ms']:8.3f} ms {r['TBps']:6.2f} TB/s  ({r['tensors']} tensors, {total:,} elements)")
    print(f"torch / longweave: {rows[1]['ms'] / rows[0]['ms']:.2f}x")
    append_json_lines(args.json, rows)


if __name__ == "__main__":
    main()
