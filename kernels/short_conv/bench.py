"""Benchmark the short convolution beside what it replaced and beside fla-core's ``causal_conv1d``, on one GPU.

    python -m kernels.short_conv.bench [--tokens 131072] [--docs 16] [--json out.json]

The KDA layer of ``small``: q, k and v (3 × 1024 channels, width 4) read as a column slice of the joint projection's
``[T, 4232]`` bf16 buffer, with the 8k stage's documents (16 of 8K in 131,072 tokens). Implementations, forward +
backward (gradients of x and the weight):

- ``longweave``: ``kernels.short_conv`` (one launch each way, output ``[3, T, 1024]``);
- ``compiled``: ``torch.compile`` of the float32 reference, the model's path before the kernel;
- ``fla``: fla-core's ``causal_conv1d`` (Triton backend, ``activation="silu"``, ``cu_seqlens``), output ``[1, T, 3072]``
  (carry fla-core as a wheel; it is an anchor, not a dependency).

Times are medians of ``triton.testing.do_bench`` (CUDA events). Bytes are the unavoidable traffic in bf16: x read
and y written forward; x and dy read and dx written backward.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kernels.benchmarking import append_json_lines, fwd_bwd_times
from kernels.short_conv import naive_short_conv_silu, short_conv_silu

CHANNELS, WIDTH, JOINT = 3 * 1024, 4, 4232
PEAK_TBPS = 4.25   # measured H200 device-copy ceiling (DESIGN.md)


def implementations(cu: torch.Tensor) -> dict[str, Callable]:
    """name -> fn(x [T, C] strided, weight [C, W], positions) -> output, each with its own argument layout."""
    compiled = torch.compile(naive_short_conv_silu)
    impls = {
        "longweave": lambda x, w, pos: short_conv_silu(x, w, pos, groups=3),
        "compiled": lambda x, w, pos: compiled(x, w, pos, 3),
    }
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d
    except ImportError:
        return impls
    # Its weight's last tap multiplies the current token (the causal-conv1d convention); ours is the first.
    impls["fla"] = lambda x, w, pos: causal_conv1d(x.unsqueeze(0), w.flip(1), activation="silu", cu_seqlens=cu)[0]
    return impls


def as_rows(y: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``[T, C]`` in channel order, from ours (a ``[T, C / groups]`` tensor per group) or fla's ``[T, C]``."""
    return y if isinstance(y, torch.Tensor) else torch.cat(y, dim=1)


def measure(name: str, fn: Callable, x: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor) -> dict:
    """Median forward and forward + backward times and rates."""
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    row = dict(impl=name, T=x.shape[0]) | fwd_bwd_times(lambda: fn(x, weight, pos), [x, weight])
    size = x.numel() * x.element_size()
    row["fwd_TBps"] = 2 * size / row["fwd_ms"] / 1e9
    row["fwdbwd_TBps"] = 5 * size / row["fwdbwd_ms"] / 1e9
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--json", help="append one JSON line per implementation here")
    args = parser.parse_args(argv)
    T = args.tokens
    lengths = [T // args.docs] * (args.docs - 1) + [T - (args.docs - 1) * (T // args.docs)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    pos = torch.cat([torch.arange(n) for n in lengths]).cuda()
    torch.manual_seed(0)
    x = torch.randn(T, JOINT, device="cuda", dtype=torch.bfloat16)[:, :CHANNELS]
    weight = (torch.randn(CHANNELS, WIDTH, device="cuda") / WIDTH ** 0.5).bfloat16()
    impls = implementations(cu)
    with torch.no_grad():   # they agree before any of them is timed ([T, C] in channel order from either layout)
        outs = {name: as_rows(fn(x, weight, pos)).float() for name, fn in impls.items()}
    for name, out in outs.items():
        err = ((out - outs["compiled"]).norm() / outs["compiled"].norm()).item()
        print(f"{name}: relative difference from the compiled reference {err:.2e}")
    del outs
    rows = [measure(name, fn, x, weight, pos) for name, fn in impls.items()]
    base = {r["impl"]: r for r in rows}["longweave"]
    print(f"{'impl':>10} {'fwd ms':>8} {'f+b ms':>8} {'fwd TB/s':>9} {'f+b TB/s':>9} {'longweave x':>12}")
    for r in rows:
        print(f"{r['impl']:>10} {r['fwd_ms']:8.3f} {r['fwdbwd_ms']:8.3f} {r['fwd_TBps']:9.2f} {r['fwdbwd_TBps']:9.2f} "
              f"{r['fwdbwd_ms'] / base['fwdbwd_ms']:11.2f}x")
    print(f"ceiling: {PEAK_TBPS} TB/s device copy; T={T}, {args.docs} documents, {CHANNELS} channels, width {WIDTH}")
    append_json_lines(args.json, rows)


if __name__ == "__main__":
    main()
