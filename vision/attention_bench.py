"""Benchmark document attention on one GPU: FlexAttention with the segment block mask (``document_attention``'s
CUDA path) beside PyTorch's variable-length flash attention (``torch.nn.attention.varlen``), same inputs.

    python -m vision.attention_bench [--tokens 131072] [--sample 8192] [--heads 8] [--head-dim 128] [--json out]

``--flex-options JSON [JSON ...]`` adds a FlexAttention run per set of kernel options (e.g. ``'{"bwd_BLOCK_M1": 32,
"bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32}'``), named flex1, flex2 … in the table, to choose a
``LONGWEAVE_FLEX_OPTIONS`` for the stage.

The default case is an MLA layer of ``small`` at the 8k stage: 131,072 tokens in 16 samples of 8,192, each sample cut
into documents at random points (``--docs-per-sample`` on average), causal inside each document. ``--bidirectional
--heads 8 --head-dim 64 --sample 392 --docs-per-sample 1`` is the vision tower's case (images of 392 patches, about
the 8k stage's typical 98 image tokens before the 2 × 2 merge; no causal mask).

FLOPs count each document's attention once: ``4 · H · D`` per visible (query, key) pair forward, 2.5 times that
backward. Times are medians of ``triton.testing.do_bench`` (CUDA events).
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from kernels.benchmarking import append_json_lines, fwd_bwd_times
from vision.attention import BACKENDS, document_attention, document_mask

PEAK_TFLOPS = 791.0   # measured H200 dense bf16 GEMM ceiling (DESIGN.md)


def segment_lengths(tokens: int, sample: int, docs_per_sample: float, seed: int) -> list[int]:
    """Document lengths: each ``sample``-token slice cut at uniform random points, ``docs_per_sample`` on average."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    for _ in range(tokens // sample):
        n_cuts = int(torch.poisson(torch.tensor([docs_per_sample - 1.0]), generator=g).item())
        cuts = sorted(set(torch.randint(1, sample, (n_cuts,), generator=g).tolist()))
        bounds = [0, *cuts, sample]
        lengths += [b - a for a, b in zip(bounds, bounds[1:])]
    return lengths


def visible_pairs(lengths: list[int], causal: bool) -> int:
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


def measure(name: str, fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flops: float) -> dict:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    row = dict(impl=name) | fwd_bwd_times(lambda: fn(q, k, v), [q, k, v])
    row["bwd_ms"] = row["fwdbwd_ms"] - row["fwd_ms"]
    row["fwd_TFLOPs"] = flops / row["fwd_ms"] / 1e9
    row["bwd_TFLOPs"] = 2.5 * flops / row["bwd_ms"] / 1e9
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--sample", type=int, default=8192)
    parser.add_argument("--docs-per-sample", type=float, default=2.0)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--bidirectional", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flex-options", nargs="*", default=[], metavar="JSON",
                        help="kernel options of one more FlexAttention run each")
    parser.add_argument("--json", help="append one JSON line per implementation here")
    args = parser.parse_args(argv)
    causal = not args.bidirectional
    lengths = segment_lengths(args.tokens, args.sample, args.docs_per_sample, args.seed)
    T, H, D = sum(lengths), args.heads, args.head_dim
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    masks = {name: document_mask(cu, T, causal=causal, backend=name, device="cuda") for name in reversed(BACKENDS)}
    torch.manual_seed(args.seed)
    # [T, H, D] rows as the model's projections give them, viewed [1, H, T, D] as the model's layers pass them.
    q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def attention(mask, options=None):  # noqa: ANN001, ANN202
        return lambda *qkv: document_attention(*(t.transpose(0, 1).unsqueeze(0) for t in qkv), mask,
                                               flex_options=options)[0].transpose(0, 1)

    impls = {name: attention(mask) for name, mask in masks.items()}
    variants = {f"flex{i + 1}": json.loads(text) for i, text in enumerate(args.flex_options)}
    impls |= {name: attention(masks["flex"], options) for name, options in variants.items()}
    # Each set of options is a recompile of the one compiled FlexAttention of this kind of mask.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(impls))
    for name, options in variants.items():
        print(f"{name}: {options}")
    with torch.no_grad():
        outs = {name: fn(q, k, v).float() for name, fn in impls.items()}
    diffs = ", ".join(f"{name} {((out - outs['flex']).norm() / outs['flex'].norm()).item():.2e}"
                      for name, out in outs.items() if name != "flex")
    print(f"{len(lengths)} segments, longest {max(lengths)}, causal={causal}; relative difference from flex: {diffs}")
    del outs
    flops = 4.0 * H * D * visible_pairs(lengths, causal)
    rows = [measure(name, fn, q, k, v, flops) | dict(T=T, H=H, D=D, causal=causal, segments=len(lengths),
                                                     options=variants.get(name))
            for name, fn in impls.items()]
    base = rows[0]
    print(f"{'impl':>8} {'fwd ms':>8} {'bwd ms':>8} {'fwd TFLOP/s':>12} {'bwd TFLOP/s':>12} {'f+b vs flex':>12}")
    for r in rows:
        print(f"{r['impl']:>8} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} {r['fwd_TFLOPs']:12.1f} {r['bwd_TFLOPs']:12.1f} "
              f"{base['fwdbwd_ms'] / r['fwdbwd_ms']:11.2f}x")
    print(f"ceiling: {PEAK_TFLOPS} TFLOP/s dense bf16 GEMM; T={T}, H={H}, D={D}")
    append_json_lines(args.json, rows)


if __name__ == "__main__":
    main()
