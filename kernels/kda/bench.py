"""Benchmark `chunk_kda` beside fla-core's `chunk_kda` (safe gate and default gate) on one GPU.

    python -m kernels.kda.bench [--lengths 8192 32768 131072 1048576] [--json out.json]
    python -m kernels.kda.bench --profile 32768   # GPU time per kernel of each implementation, forward + backward
    python -m kernels.kda.bench --profile 65536 --varlen   # the same on the varlen batch

B = 1, H = 16 (`--heads`), K = V = 128, bf16 q/k/v, g = -5 sigmoid(randn) in float32, beta in (0, 1), q/k
L2-normalised by each implementation, plus a 64K varlen batch of 34 documents. `longweave-gate` takes raw bf16 z
and computes the bounded gate in the kernels; `longweave-segments` is that in checkpointed segments of 128K tokens
(`chunk_kda_segmented`: one extra forward, a fraction of the memory; run only above 128K); `-c32` runs the same in
chunks of 32 tokens (`chunk_size=32`). Times are medians of `triton.testing.do_bench` (CUDA events). FLOPs count
the chunk algorithm's dense matrix products per chunk of C = 64 and head, for every implementation (so rates
compare times): 4 C^2 K (A_qk, A_kk) + 2 C^2 (K + V) (w, u) + 2 C^2 V (A_qk v_new) + 6 C K V (w S, q S, k^T v_new)
forward, and three times that forward + backward. Bytes are the unavoidable traffic: every input read once and
every output written once (forward + backward: inputs and dO read again, every gradient written).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
from collections.abc import Callable

import torch
import triton

from kernels.kda import chunk_kda, chunk_kda_segmented

H, D, C = 16, 128, 64
SEGMENT = 131072   # longweave-segments: checkpointed segments of this many tokens (only for longer sequences)
# These take raw bf16 z and compute the bounded gate in the kernels.
GATED = {"longweave-gate", "longweave-gate-c32", "longweave-segments"}
PEAK_TFLOPS, PEAK_TBPS = 791.0, 4.25   # measured H200 ceilings (DESIGN.md): bf16 GEMM, device copy
log = logging.getLogger("kda.bench")


def doc_lengths(total: int, n: int, seed: int = 0) -> list[int]:
    """n log-normal document lengths (median ~1.2K, long tail) summing to total."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(n, generator=gen) * 1.0 + 7.0)
    lengths = (raw / raw.sum() * total).floor().long().clamp(min=1)
    lengths[lengths.argmax()] += total - lengths.sum()
    return lengths.tolist()


def make_inputs(T: int, gate: bool, H: int = H) -> dict[str, torch.Tensor]:
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x = dict(q=torch.randn(1, T, H, D, **kw), k=torch.randn(1, T, H, D, **kw), v=torch.randn(1, T, H, D, **kw),
             beta=torch.rand(1, T, H, **kw))
    if gate:
        x["g"] = torch.randn(1, T, H, D, **kw)
    else:
        x["g"] = -5 * torch.sigmoid(torch.randn(1, T, H, D, device="cuda"))
    for t in x.values():
        t.requires_grad_()
    x["A_log"] = torch.zeros(H, device="cuda")  # the in-kernel gate's parameter (no gradient measured)
    return x


def implementations() -> dict[str, Callable]:
    impls = {
        "longweave": lambda x, cu: chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu,
                                             use_qk_l2norm=True),
        "longweave-gate": lambda x, cu: chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu,
                                                  A_log=x["A_log"], use_qk_l2norm=True),
        "longweave-c32": lambda x, cu: chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu,
                                                 use_qk_l2norm=True, chunk_size=32),
        "longweave-gate-c32": lambda x, cu: chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu,
                                                      A_log=x["A_log"], use_qk_l2norm=True, chunk_size=32),
        "longweave-segments": lambda x, cu: chunk_kda_segmented(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                                segment_tokens=SEGMENT, cu_seqlens=cu,
                                                                A_log=x["A_log"], use_qk_l2norm=True),
    }
    try:
        from fla.ops.kda import chunk_kda as fla_kda
    except ImportError:
        log.warning("fla-core is not importable: no anchor in this run")
        return impls
    impls["fla-safe"] = lambda x, cu: fla_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu,
                                              use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0)
    impls["fla-default"] = lambda x, cu: fla_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu,
                                                 use_qk_l2norm_in_kernel=True)
    return impls


def measure(name: str, fn: Callable, T: int, cu: torch.Tensor | None, H: int = H) -> dict:
    """Median forward and forward+backward times, rates and peak memory of one implementation at one shape."""
    x = make_inputs(T, name in GATED, H)
    inputs = [x[n] for n in ("q", "k", "v", "g", "beta")]
    row = dict(impl=name, T=T, H=H, docs=1 if cu is None else cu.numel() - 1)
    try:
        do = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)

        def step() -> None:
            fn(x, cu)[0].backward(do)

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        row["fwd_ms"] = triton.testing.do_bench(lambda: fn(x, cu), grad_to_none=inputs, return_mode="median")
        row["fwdbwd_ms"] = triton.testing.do_bench(step, grad_to_none=inputs, return_mode="median")
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    del x, inputs
    gc.collect()
    torch.cuda.empty_cache()
    if "fwd_ms" in row:
        n_chunks = (T + C - 1) // C
        flops = H * n_chunks * (4 * C * C * D + 2 * C * C * 2 * D + 2 * C * C * D + 6 * C * D * D)
        in_bytes = T * H * (3 * D * 2 + D * (2 if name in GATED else 4) + 2)
        out_bytes = T * H * D * 2
        row["fwd_TFLOPs"] = flops / row["fwd_ms"] / 1e9
        row["fwdbwd_TFLOPs"] = 3 * flops / row["fwdbwd_ms"] / 1e9
        row["fwd_TBps"] = (in_bytes + out_bytes) / row["fwd_ms"] / 1e9
        row["fwdbwd_TBps"] = (3 * in_bytes + 2 * out_bytes) / row["fwdbwd_ms"] / 1e9
    return row


def varlen_batch(total: int = 65536, docs: int = 34) -> torch.Tensor:
    """cu_seqlens of the varlen batch: real-looking document lengths packed into one sequence."""
    return torch.tensor([0, *torch.tensor(doc_lengths(total, docs)).cumsum(0).tolist()], device="cuda")


def profile_kernels(impls: dict[str, Callable], T: int, cu: torch.Tensor | None, H: int = H, repeat: int = 3) -> None:
    """Print each implementation's GPU kernels by total time over `repeat` warm forward + backward passes."""
    from torch.profiler import ProfilerActivity, profile

    for name, fn in impls.items():
        x = make_inputs(T, name in GATED, H)
        do = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            fn(x, cu)[0].backward(do)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeat):
                fn(x, cu)[0].backward(do)
            torch.cuda.synchronize()
        docs = 1 if cu is None else cu.numel() - 1
        print(f"== {name} T={T} H={H} docs={docs}, {repeat} forward+backward passes")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        del x, do
        torch.cuda.empty_cache()


def table(rows: list[dict]) -> str:
    head = f"{'shape':>27} {'impl':>18} {'fwd ms':>8} {'f+b ms':>8} {'f+b TF/s':>8} {'f+b TB/s':>8} " \
           f"{'peak GiB':>8} {'x fla-safe':>10}"
    lines = [head]
    base = {(r["T"], r["docs"]): r.get("fwdbwd_ms") for r in rows if r["impl"] == "fla-safe"}
    for r in rows:
        shape = f"T={r['T']} H={r['H']} docs={r['docs']}"
        if "error" in r:
            lines.append(f"{shape:>27} {r['impl']:>18} {r['error']}")
            continue
        ref = base.get((r["T"], r["docs"]))
        ratio = f"{ref / r['fwdbwd_ms']:.2f}x" if ref else "-"
        lines.append(f"{shape:>27} {r['impl']:>18} {r['fwd_ms']:8.2f} {r['fwdbwd_ms']:8.2f} "
                     f"{r['fwdbwd_TFLOPs']:8.1f} {r['fwdbwd_TBps']:8.2f} {r['peak_GiB']:8.1f} {ratio:>10}")
    lines.append(f"ceilings: {PEAK_TFLOPS} TFLOP/s bf16 GEMM, {PEAK_TBPS} TB/s device copy")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072, 1048576])
    parser.add_argument("--impls", nargs="+", default=None, help="subset of implementations to run")
    parser.add_argument("--json", default=None, help="write the raw rows here")
    parser.add_argument("--profile", type=int, default=None, metavar="T",
                        help="instead of timing, print the GPU kernels of each implementation at length T")
    parser.add_argument("--varlen", action="store_true", help="profile the varlen batch (T = 65536 then)")
    parser.add_argument("--heads", type=int, default=H, help="H (the `small` model's KDA layers have 8)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    impls = implementations()
    if args.impls:
        impls = {n: f for n, f in impls.items() if n in args.impls}
    if args.profile:
        profile_kernels(impls, 65536 if args.varlen else args.profile, varlen_batch() if args.varlen else None,
                        args.heads)
        return
    shapes = [(T, None) for T in args.lengths] + [(65536, varlen_batch())]
    rows = []
    # Implementation by implementation, so a run cut short still holds every shape of the first ones.
    for name, fn in impls.items():
        for T, cu_seqlens in shapes:
            if T > 2**19 and name == "fla-default":
                continue  # the safe gate path already shows fla's memory wall at this length
            if T <= SEGMENT and name == "longweave-segments":
                continue  # one segment: the same call as longweave-gate
            rows.append(measure(name, fn, T, cu_seqlens, args.heads))
            log.info(json.dumps(rows[-1]))
    rows.sort(key=lambda r: (r["docs"], r["T"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
