"""How much a dense GEMM on a second stream hides under the KDA kernels (latency-bound, two programs an SM): the
upper bound on what running weight-gradient GEMMs beside them would save. One GPU, the 8k stage's KDA shape
(65,536 tokens in 8 documents, H = 8, K = V = 128, bf16, the gate in the kernels) and a weight-gradient-sized GEMM
([1024, 65536] x [65536, 4232], the KDA joint projection's).

    python devrun/overlap_probe.py [--rounds 20]
"""
from __future__ import annotations

import argparse

import torch

from kernels.kda import chunk_kda


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    T, H, K = 65536, 8, 128
    kw = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v, z = (torch.randn(1, T, H, K, **kw).requires_grad_() for _ in range(4))
    with torch.no_grad():
        q /= q.norm(dim=-1, keepdim=True)
        k /= k.norm(dim=-1, keepdim=True)
    beta = torch.rand(1, T, H, **kw).requires_grad_()
    A_log = torch.zeros(H, device="cuda", requires_grad=True)
    cu = torch.arange(9, dtype=torch.int32) * (T // 8)
    do = torch.randn(1, T, H, K, **kw)
    a, b = torch.randn(1024, T, **kw), torch.randn(T, 4232, **kw)

    def kda() -> None:
        o, _ = chunk_kda(q, k, v, z, beta, cu_seqlens=cu, A_log=A_log)
        o.backward(do)

    def gemm() -> None:
        torch.mm(a, b)

    def timed(streams: dict[torch.cuda.Stream, object]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for stream in streams:
            stream.wait_event(start)
        for _ in range(args.rounds):  # interleaved, so both queues stay full
            for stream, fn in streams.items():
                with torch.cuda.stream(stream):
                    fn()
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / args.rounds

    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    kda(), gemm()  # compiles and autotuning
    for rep in range(2):
        t_kda, t_gemm = timed({s1: kda}), timed({s1: gemm})
        t_both = timed({s1: kda, s2: gemm})
        print(f"round {rep}: KDA fwd+bwd {t_kda:.3f} ms, GEMM {t_gemm:.3f} ms, sum {t_kda + t_gemm:.3f}, "
              f"side by side {t_both:.3f} ms ({t_both / (t_kda + t_gemm):.3f}x the sum; "
              f"{(t_kda + t_gemm - t_both) / t_gemm:.0%} of the GEMM hidden)")


if __name__ == "__main__":
    main()
