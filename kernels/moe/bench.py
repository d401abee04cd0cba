"""MoE layer forward+backward benchmark (bf16, CUDA): `python -m kernels.moe.bench`.

16K tokens, d=2048, expert width 1024, top-8 of E in (64, 256), no shared expert (DeepSpeed's MoE has
none). Beside our layer (torch._grouped_mm and Triton backends) in the same run: the per-expert loop,
DeepSpeed's `deepspeed.moe.layer.MoE`, bare torch._grouped_mm SwiGLU experts on perfectly balanced
groups, and a dense matmul of the same FLOPs (the ceiling). TFLOP/s count the active expert FLOPs
`3 · 6 · d · F · T · k` (forward + two backward GEMMs). Prints a markdown table.

`--histogram` times only the quantile balancer's residual histogram at the 8k stage's shape (65,536 tokens, 128
experts, 1,000 bins), the Triton kernel beside the PyTorch reference it replaced.
"""
from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import triton
from torch import nn
from triton.testing import do_bench

from .grouped_gemm import grouped_mm_fwd
from .histogram import add_residual_histogram, residual_histogram
from .layer import MoELayer, moe_experts
from .permute import plan_routing
from .router import _route

log = logging.getLogger("kernels.moe.bench")
T, D, F_DIM, K = 16384, 2048, 1024, 8
SWEEP = [
    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "num_warps": w, "num_stages": s}
    for bm, bn, w, s in [(128, 128, 8, 4), (128, 256, 8, 3), (128, 128, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4), (64, 256, 8, 3)]
]


def expert_flops(n_tokens: int = T) -> float:
    """Active expert FLOPs of one forward+backward."""
    return 3 * 6 * D * F_DIM * n_tokens * K


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds by CUDA events."""
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def kernel_ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Summed GPU kernel time of one call (torch.profiler), free of the launch gaps that dominate
    small-kernel code timed on its own; inside the layer those launches overlap the GEMMs."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / iters / 1e3


def fwd_bwd(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dout: torch.Tensor,
            after: Callable[[], object] | None = None) -> Callable[[], None]:
    """One training step of module on x (grads into x and the parameters)."""
    def step() -> None:
        out = module(x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dout)
        if after is not None:
            after()
    return step


class SwiGLUExpert(nn.Module):
    """DeepSpeed's expert: the same SwiGLU as ours, as Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.w13 = nn.Linear(D, 2 * F_DIM, bias=False)
        self.w2 = nn.Linear(F_DIM, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(nn.functional.silu(gate) * up)


def deepspeed_moe(n_experts: int) -> nn.Module:
    """deepspeed.moe.layer.MoE of the same size, dropless, on a world of one."""
    import deepspeed
    from deepspeed.moe.layer import MoE

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        deepspeed.init_distributed(dist_backend="nccl")
    moe = MoE(D, SwiGLUExpert(), num_experts=n_experts, ep_size=1, k=K, drop_tokens=False, use_rts=False)
    moe.set_deepspeed_parallelism()
    return moe.cuda().to(torch.bfloat16)


def bench_case(n_experts: int, rows: list[tuple[str, float, float]]) -> None:
    """Time every variant for one expert count, appending (name, ms, FLOPs) rows."""
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)

    def add(name: str, make: Callable[[], Callable[[], object]], flops: float = expert_flops()) -> None:
        try:
            ms = time_ms(make())
        except Exception as err:  # one failing variant must not lose the rest of the run
            log.warning("%s failed: %s", name, err)
            ms = float("nan")
        rows.append((f"E={n_experts} {name}", ms, flops))
        log.warning("E=%d %-40s %8.3f ms", n_experts, name, ms)

    for backend in ("torch", "triton", "loop"):
        layer = MoELayer(D, F_DIM, n_experts, K, n_shared=0, backend=backend).cuda().to(torch.bfloat16)
        add(f"layer {backend} (incl. bias update)", lambda: fwd_bwd(layer, x, dout, layer.step_balance))
        if backend == "torch":
            add("layer torch, no bias update", lambda: fwd_bwd(layer, x, dout))

            def router_and_update() -> None:
                r = _route(x.detach(), layer.router.detach(), layer.balancer.bias, K, 1.0)
                layer.balancer.observe(r.scores, r.alpha, r.expert_idx)
                layer.balancer.step()
            add("router + quantile update (fwd only)", lambda: router_and_update, float("nan"))
            rows.append((f"E={n_experts} router + quantile update, GPU kernel time", kernel_ms(router_and_update), float("nan")))
            log.warning("%s", rows[-1])
        del layer

    # Slot j of token t goes to expert (t·k + j) mod E: every expert gets T·k / E rows.
    plan = plan_routing(torch.arange(T * K, device="cuda").view(T, K) % n_experts, n_experts)
    offs = plan.offs
    xs = torch.randn(T * K, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w13 = torch.randn(n_experts, D, 2 * F_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(n_experts, F_DIM, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dys = torch.randn(T * K, D, device="cuda", dtype=torch.bfloat16)
    row_gates = torch.rand(T * K, device="cuda")
    for backend in ("torch", "triton"):
        add(f"bare experts {backend}, balanced",
            lambda: fwd_bwd(lambda t: moe_experts(t, w13, w2, plan, row_gates, backend), x, dys))
    for cfg in SWEEP if n_experts == 64 else []:
        name = "triton fwd GEMM x·w13 " + "-".join(str(v) for v in cfg.values())
        add(name, lambda: (lambda: grouped_mm_fwd(xs.detach(), w13.detach(), offs, cfg)), 2 * T * K * D * 2 * F_DIM)
    add("DeepSpeed MoE", lambda: fwd_bwd(deepspeed_moe(n_experts), x.view(1, T, D), dout.view(1, T, D)))


def histogram_rows(n_tokens: int = 65536, n_experts: int = 128, n_bins: int = 1000) -> list[tuple[str, float, float]]:
    """The balancer's per-forward histogram: PyTorch (the reference) and the Triton kernel, wall and kernel time."""
    scores = torch.rand(n_tokens, n_experts, device="cuda")
    alpha, bias = torch.rand(n_tokens, device="cuda"), torch.randn(n_experts, device="cuda") * 0.3
    hist = torch.zeros(n_experts, n_bins, dtype=torch.int64, device="cuda")
    impls = {"PyTorch": lambda: hist.add_(residual_histogram(alpha.unsqueeze(1) - scores, bias, n_bins)),
             "Triton": lambda: add_residual_histogram(hist, scores, alpha, bias)}
    shape = f"{n_tokens:,} x {n_experts}, {n_bins} bins"
    return [row for name, fn in impls.items()
            for row in ((f"residual histogram {shape}, {name}", time_ms(fn), float("nan")),
                        (f"residual histogram {shape}, {name}, GPU kernel time", kernel_ms(fn), float("nan")))]


def dense_ceiling_ms() -> float:
    """A dense bf16 GEMM with the forward's expert FLOPs ([T·k, d] @ [d, 3F]), times 3."""
    a = torch.randn(T * K, D, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(D, 3 * F_DIM, device="cuda", dtype=torch.bfloat16)
    return 3 * time_ms(lambda: a @ b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--histogram", action="store_true", help="only the balancer's residual histogram")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.manual_seed(0)
    log.warning("torch %s, triton %s, %s", torch.__version__, triton.__version__, torch.cuda.get_device_name())
    rows = histogram_rows()
    if not args.histogram:
        rows.append(("dense bf16 GEMM, same FLOPs (ceiling)", dense_ceiling_ms(), expert_flops()))
        for n_experts in args.experts:
            bench_case(n_experts, rows)
    print("| variant | ms | TFLOP/s (active expert) |\n|---|---:|---:|")
    for name, ms, flops in rows:
        print(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} |")


if __name__ == "__main__":
    main()
