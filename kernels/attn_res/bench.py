"""Benchmark the AttnRes mixture kernels beside what they replaced, on one GPU.

    python -m kernels.attn_res.bench [--tokens 131072] [--width 1024] [--sources 9] [--impls longweave ...]
        [--block S] [--json out.json]

A last-block sublayer of ``small`` at the 8k stage: 9 sources of 131,072 × 1,024 in bf16, with and without the
sublayer's fused RMSNorm. Implementations, forward + backward (gradients of every source, its inv_rms, the
pseudo-query and the norm weight):

- ``longweave``: ``kernels.attn_res`` (one launch each way);
- ``compiled``: ``torch.compile`` of the reference, the model's path before the kernels;
- ``eager``: the reference as it runs uncompiled.

``--block S`` times one whole block of S sublayers instead (``--sources`` finished blocks, sinked as in the model,
and the open block from the second sublayer on; each sublayer's normed input): ``per-sublayer``, one fused mixture
each (``attn_res_mix``), against ``two-phase``, the block's parts at once and a merge each (``kernels.attn_res.block``).

Times are medians of ``triton.testing.do_bench`` (CUDA events). Bytes are the unavoidable bf16 traffic: the sources
read and the output written forward; the sources and dy read and every source's gradient written backward.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kernels.attn_res import (GradSink, attn_res_block_mix, attn_res_merge, attn_res_mix, naive_attn_res_mix,
                              sinked)
from kernels.benchmarking import append_json_lines, fwd_bwd_times

PEAK_TBPS = 4.25   # measured H200 device-copy ceiling (DESIGN.md)
IMPLS: dict[str, Callable[[], Callable]] = {
    "longweave": lambda: attn_res_mix,
    "compiled": lambda: torch.compile(naive_attn_res_mix),
    "eager": lambda: naive_attn_res_mix,
}


def measure(name: str, fn: Callable, sources: list[torch.Tensor], rms: list[torch.Tensor], query: torch.Tensor,
            weight: torch.Tensor | None) -> dict:
    """Median forward and forward + backward times and rates."""
    leaves = [s.detach().requires_grad_() for s in sources] + [r.detach().requires_grad_() for r in rms]
    query = query.detach().requires_grad_()
    weight = None if weight is None else weight.detach().requires_grad_()
    n = len(sources)
    params = leaves + [query] + ([] if weight is None else [weight])
    row = dict(impl=name, norm=weight is not None, T=sources[0].shape[0], n=n) | fwd_bwd_times(
        lambda: fn(leaves[:n], leaves[n:], query, weight, None if weight is None else 1e-6), params)
    size = sources[0].numel() * sources[0].element_size()
    row["fwd_TBps"] = (n + 1) * size / row["fwd_ms"] / 1e9
    row["fwdbwd_TBps"] = (3 * n + 2) * size / row["fwdbwd_ms"] / 1e9
    return row


def worst_errors(sources: list[torch.Tensor], rms: list[torch.Tensor], query: torch.Tensor,
                 weight: torch.Tensor | None) -> tuple[float, tuple[str, float]]:
    """longweave's relative error against the float32 reference: the output's, and the worst gradient's (name,
    error). Gradients too: a race in the backward once left the last source's gradient 15% off while the output
    was right (2026-12-05)."""
    eps = None if weight is None else 1e-6
    dy = torch.randn_like(sources[0])
    outputs = {}
    for name, fn, wide in (("ref", naive_attn_res_mix, True), ("ours", attn_res_mix, False)):
        leaves = [(s.float() if wide else s).detach().requires_grad_() for s in sources]
        leaves += [r.detach().requires_grad_() for r in rms] + [query.detach().requires_grad_()]
        if weight is not None:
            leaves.append(weight.detach().requires_grad_())
        n = len(sources)
        y = fn(leaves[:n], leaves[n:2 * n], leaves[2 * n], None if weight is None else leaves[-1], eps)
        y.backward(dy.float() if wide else dy)
        outputs[name] = [y.detach().float()] + [leaf.grad.float() for leaf in leaves]
        del leaves, y
    names = [f"dsrc{i}" for i in range(len(sources))] + [f"drms{i}" for i in range(len(sources))] + ["dq", "dg"]
    errors = [((a - b).norm() / b.norm()).item() for a, b in zip(outputs["ours"], outputs["ref"])]
    return errors[0], max(zip(names, errors[1:]), key=lambda kv: kv[1])


def block_rows(T: int, D: int, n: int, S: int) -> list[dict]:
    """One block of S sublayers, one mixture each against two phases: forward and forward + backward times."""
    finished = [(torch.randn(T, D, device="cuda") * (0.5 + i)).bfloat16() for i in range(n)]
    partial = torch.randn(T, D, device="cuda").bfloat16()
    queries, weights = torch.randn(S, D, device="cuda"), 1 + 0.1 * torch.randn(S, D, device="cuda")
    leaves = [t.requires_grad_() for t in finished + [partial, queries, weights]]
    rms = [torch.rsqrt((t.detach().float() ** 2).mean(-1) + 1e-6) for t in finished + [partial]]

    def block(two_phase: bool) -> list[torch.Tensor]:
        sinks = [GradSink() for _ in finished]
        blocks = [sinked(b, sink) for b, sink in zip(finished, sinks)]
        mixture = attn_res_block_mix(blocks, rms[:n], queries, sinks=sinks) if two_phase else None
        outs = []
        for l in range(S):
            p, rp = (partial, rms[n]) if l else (None, None)
            if two_phase:
                outs.append(attn_res_merge(mixture, l, p, rp, queries[l], weights[l], 1e-6))
            else:
                outs.append(attn_res_mix(blocks + ([p] if l else []), rms[:n] + ([rp] if l else []), queries[l],
                                         weights[l], 1e-6, sinks=sinks + ([None] if l else [])))
        return outs

    dys = [torch.randn_like(partial) for _ in range(S)]
    results = []
    for two in (False, True):  # the two ways' outputs and gradients, for their worst relative difference
        outs = block(two)
        torch.autograd.backward(outs, dys)
        results.append([y.detach().float() for y in outs] + [t.grad.float() for t in leaves])
        for t in leaves:
            t.grad = None
    names = [f"y{l}" for l in range(S)] + [f"dsrc{i}" for i in range(n)] + ["dpartial", "dq", "dg"]
    gap = max(zip(names, [((a - b).norm() / b.norm()).item() for a, b in zip(results[1], results[0])]),
              key=lambda kv: kv[1])
    print(f"two-phase against per-sublayer (both bf16): worst relative difference {gap[1]:.2e} ({gap[0]})")
    return [dict(impl=name, T=T, n=n, S=S, worst_gap=gap[1]) | fwd_bwd_times(lambda two=two: block(two), leaves)
            for name, two in (("per-sublayer", False), ("two-phase", True))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--sources", type=int, default=9)
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                        help="which to time (the compiled reference adds its compile: all three did not finish in 75 s "
                             "on the H200, 2026-12-04)")
    parser.add_argument("--block", type=int, metavar="S", help="time a block of S sublayers both ways instead")
    parser.add_argument("--json", help="append one JSON line per implementation and case here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    T, D, n = args.tokens, args.width, args.sources
    if args.block:
        rows = block_rows(T, D, n, args.block)
        for r in rows:
            print(f"{r['impl']:>13} T={T} finished={n} sublayers={r['S']}: fwd {r['fwd_ms']:.3f} ms, f+b "
                  f"{r['fwdbwd_ms']:.3f} ms ({rows[0]['fwdbwd_ms'] / r['fwdbwd_ms']:.2f}x per-sublayer's)")
        append_json_lines(args.json, rows)
        return
    sources = [(torch.randn(T, D, device="cuda") * (0.5 + i)).bfloat16() for i in range(n)]
    rms = [torch.rsqrt((s.float() ** 2).mean(-1) + 1e-6) for s in sources]
    query = torch.randn(D, device="cuda")
    impls = {name: IMPLS[name]() for name in args.impls}
    rows = []
    for weight in (None, 1 + 0.1 * torch.randn(D, device="cuda")):
        err, (worst, grad_err) = worst_errors(sources, rms, query, weight)
        print(f"norm={weight is not None}: longweave's relative error against the float32 reference: output "
              f"{err:.2e}, worst gradient {grad_err:.2e} ({worst})")
        rows += [measure(name, fn, sources, rms, query, weight) for name, fn in impls.items()]
    print(f"{'impl':>10} {'norm':>5} {'fwd ms':>8} {'f+b ms':>8} {'fwd TB/s':>9} {'f+b TB/s':>9} "
          f"{'vs ' + rows[0]['impl']:>13}")
    for r in rows:
        base = next(b for b in rows if b["impl"] == rows[0]["impl"] and b["norm"] == r["norm"])
        print(f"{r['impl']:>10} {r['norm']!s:>5} {r['fwd_ms']:8.3f} {r['fwdbwd_ms']:8.3f} {r['fwd_TBps']:9.2f} "
              f"{r['fwdbwd_TBps']:9.2f} {r['fwdbwd_ms'] / base['fwdbwd_ms']:12.2f}x")
    print(f"ceiling: {PEAK_TBPS} TB/s device copy; T={T}, d={D}, {n} sources")
    append_json_lines(args.json, rows)


if __name__ == "__main__":
    main()
