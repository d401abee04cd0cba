"""``acc += x`` for a float32 sum and a bf16 (or fp16, fp32) gradient, as one vectorised Triton kernel.

The trainer sums each micro-batch's bf16 gradients into float32 (``trainer.engine``): 1.92 B parameters for
``small``, 16 micro-batches a step. PyTorch's ``add_`` of tensors of two dtypes runs its unrolled kernel with a cast
per load, not the vectorised one: 134 ms of an 8.86 s step on the H200 (2026-12-06 profile; 8,608 launches, about
2.3 TB/s of the 10 bytes a parameter it moves). This kernel reads both in 16-byte vectors.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.accumulate.naive import naive_add_into

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 4096  # elements a program: 16 float32 a thread at 8 warps
# Below this many elements the reference: a Triton launch costs the host about 26 us against PyTorch's 19 (H100,
# 2026-12-06: all 538 of small's parameters through the kernel took 14.2 ms against 10.1 in a row, host-bound),
# while the add itself is a few microseconds.
KERNEL_MIN = 1 << 20


@triton.jit
def add_into_kernel(acc, x, n, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    b_acc = tl.load(acc + o, mask=m)
    tl.store(acc + o, b_acc + tl.load(x + o, mask=m).to(tl.float32), mask=m)


def add_into(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``acc += x`` in place (acc float32, x of the same number of elements, any float dtype); returns acc. The
    kernel on CUDA (and under ``TRITON_INTERPRET=1``) when both are contiguous and hold ``KERNEL_MIN`` elements or
    more; the reference otherwise."""
    n = acc.numel()
    if acc.dtype != torch.float32 or n != x.numel():
        raise ValueError(f"add_into: acc must be float32 with x's {x.numel()} elements, got {acc.dtype} "
                         f"{tuple(acc.shape)}")
    if n < KERNEL_MIN or not (acc.is_contiguous() and x.is_contiguous() and (acc.is_cuda or INTERPRET)):
        return naive_add_into(acc, x)
    add_into_kernel[(triton.cdiv(n, BLOCK),)](acc, x, n, BLOCK=BLOCK, num_warps=8)
    return acc
