"""The router's top-k of biased scores as one Triton kernel: each program takes whole rows and picks their k largest
by k passes of max over registers.

``torch.topk(scores + bias, k + 1)`` over ``[T, 128]`` rows ran at 0.86 ms per call at 131K tokens on the H200 (the
8k stage's profile, BENCHMARKS.md), and a step calls it 38 times (19 MoE layers, forward and recompute). Reading the
scores once takes about 16 µs at the H200's copy rate.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grouped_gemm import interpreting

ROWS = 32  # rows per program on a GPU: 32 x 128 float32 keeps every load wide
INTERPRETER_ROWS = 4096  # the interpreter runs a program's block as one numpy array: few large blocks are fast


@triton.jit
def biased_topk_kernel(scores, bias, values, indices, T, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                       BT: tl.constexpr):
    o_t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    o_e = tl.arange(0, EP)
    m_t, m_e = o_t < T, o_e < E
    b_s = tl.load(scores + o_t[:, None] * E + o_e[None, :], mask=m_t[:, None] & m_e[None, :], other=0.)
    b_s += tl.load(bias + o_e, mask=m_e, other=0.)[None, :]
    b_s = tl.where(m_e[None, :], b_s, float("-inf"))
    for j in tl.static_range(K):
        b_v = tl.max(b_s, 1)
        b_i = tl.argmax(b_s, 1, tie_break_left=True)
        tl.store(values + o_t * K + j, b_v, mask=m_t)
        tl.store(indices + o_t * K + j, b_i.to(tl.int64), mask=m_t)
        b_s = tl.where(o_e[None, :] == b_i[:, None], float("-inf"), b_s)


def biased_topk(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(scores + bias, k, dim=-1)`` (values in descending order) for float32 scores ``[T, E]`` and bias
    ``[E]``: values float32 ``[T, k]`` and indices int64 ``[T, k]``; of equal values the lower expert comes first.
    The kernel on CUDA and under the interpreter, ``torch.topk`` elsewhere."""
    if not (scores.is_cuda or interpreting()):
        return torch.topk(scores + bias, k, dim=-1, sorted=True)
    T, E = scores.shape
    values = torch.empty(T, k, dtype=torch.float32, device=scores.device)
    indices = torch.empty(T, k, dtype=torch.int64, device=scores.device)
    rows = ROWS if scores.is_cuda else INTERPRETER_ROWS
    if T:
        biased_topk_kernel[(triton.cdiv(T, rows),)](scores.float().contiguous(), bias.float().contiguous(), values,
                                                     indices, T, E=E, EP=triton.next_power_of_2(E), K=k, BT=rows,
                                                     num_warps=8)  # sm_90, E=128: 95 registers (190 with 4 warps)
    return values, indices
