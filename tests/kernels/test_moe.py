"""MoE layer: kernels against the per-expert loop reference, quantile balancing, and the DP histogram."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

from checks import fresh_seed, rel_err
from interpreted import INTERPRET, import_interpreted

import_interpreted("kernels.moe")

from kernels.moe import (
    MoELayer,
    QuantileBalancer,
    combine,
    grouped_mm,
    naive_bias_update,
    naive_moe,
    permute,
    plan_routing,
    route,
    swiglu,
)
from kernels.moe.balance import exact_quantile_bias
from kernels.moe.grouped_gemm import loop_grouped_mm
from kernels.moe.histogram import add_residual_histogram, residual_histogram
from kernels.moe.topk import biased_topk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# torch._grouped_mm in float32: on the CPU (torch >= 2.14), not by the CUDA kernels of older releases.
TORCH_FP32 = pytest.param("torch", marks=pytest.mark.skipif(DEVICE == "cuda", reason="CUDA grouped GEMM is bf16"))


def zipf_logits(gen: torch.Generator, n_tokens: int, n_experts: int, strength: float = 4.0) -> torch.Tensor:
    """Router logits `[T, E]`: noise plus a preference strength/rank, so a few experts take most tokens."""
    pref = strength / torch.arange(1, n_experts + 1, dtype=torch.float32)
    return torch.randn(n_tokens, n_experts, generator=gen) + pref


def observe_batch(balancer: QuantileBalancer, scores: torch.Tensor) -> None:
    """Route scores `[T, E]` with the balancer's bias and let it observe them."""
    biased, chosen = torch.topk(scores + balancer.bias, balancer.top_k + 1, dim=-1)
    balancer.observe(scores, biased[:, -1], chosen[:, :-1])


def balance_run(balancer: QuantileBalancer, gen: torch.Generator, steps: int) -> list[float]:
    """Route fresh Zipf batches (E=64, k=8, 16K tokens) and step the bias; the max/mean load of each step."""
    loads = []
    for _ in range(steps):
        observe_batch(balancer, torch.sigmoid(zipf_logits(gen, 16384, balancer.n_experts)))
        loads.append(balancer.step().max_over_mean.item())
    return loads


# ---------------------------------------------------------------- kernels vs the loop reference


@pytest.mark.parametrize("counts", [[5, 0, 37, 20], [1, 16, 17, 0, 3]], ids=["E4-empty", "E5-edges"])
def test_grouped_mm_triton_matches_loop(counts: list[int]) -> None:
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(DEVICE)
    x = torch.randn(sum(counts), 24, device=DEVICE, requires_grad=True)
    w = torch.randn(len(counts), 24, 40, device=DEVICE, requires_grad=True)
    dy = torch.randn(sum(counts), 40, device=DEVICE)
    out = grouped_mm(x, w, offs, backend="triton")
    dx, dw = torch.autograd.grad(out, (x, w), dy)
    ref = loop_grouped_mm(x, w, offs)
    rdx, rdw = torch.autograd.grad(ref, (x, w), dy)
    for name, a, b in [("y", out, ref), ("dx", dx, rdx), ("dw", dw, rdw)]:
        assert rel_err(a, b) <= 1e-5, name


@pytest.mark.parametrize("rows, f_dim, scaled", [(37, 48, False), (37, 48, True), (5, 1100, True)],
                         ids=["plain", "scaled", "scaled-two-column-blocks"])
def test_swiglu_matches_reference(rows: int, f_dim: int, scaled: bool) -> None:
    """Forward and every gradient (h, and the per-row scale when given) against the PyTorch expression."""
    fresh_seed()
    h = torch.randn(rows, 2 * f_dim, device=DEVICE, requires_grad=True)
    scale = torch.rand(rows, device=DEVICE, requires_grad=True) if scaled else None
    da = torch.randn(rows, f_dim, device=DEVICE)
    leaves = (h,) if scale is None else (h, scale)
    out = swiglu(h, scale=scale)
    grads = torch.autograd.grad(out, leaves, da)
    gate, up = h.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up * (1 if scale is None else scale[:, None])
    ref_grads = torch.autograd.grad(ref, leaves, da)
    assert rel_err(out, ref) <= 1e-5
    for name, a, b in zip(("dh", "dscale"), grads, ref_grads):
        assert rel_err(a, b) <= 1e-5, name


def test_swiglu_scale_must_match_rows() -> None:
    with pytest.raises(ValueError, match="scale: expected one value per row"):
        swiglu(torch.randn(4, 8, device=DEVICE), scale=torch.ones(3, device=DEVICE))


def test_permute_and_combine_are_transposes() -> None:
    """permute spreads each token to its k slots in expert order, combine sums the slots back; each one's backward
    is the other's forward (checked against index_add / index_select through autograd)."""
    fresh_seed()
    t, k, e, d = 19, 3, 5, 8
    x = torch.randn(t, d, requires_grad=True)
    expert_idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    plan = plan_routing(expert_idx, e)
    assert plan.counts.sum().item() == t * k
    xs = permute(x, plan)
    assert torch.equal(plan.order.sort().values, torch.arange(t * k))
    assert torch.equal(expert_idx.reshape(-1)[plan.order], expert_idx.reshape(-1).sort().values)
    scale = torch.randn(t * k, 1)
    out = combine(xs * scale, plan)
    token = plan.order // k
    ref = torch.zeros(t, d).index_add(0, token, x[token] * scale)
    dout = torch.randn(t, d)
    (grad,) = torch.autograd.grad(out, x, dout)
    (ref_grad,) = torch.autograd.grad(ref, x, dout)
    assert rel_err(out, ref) <= 1e-6 and rel_err(grad, ref_grad) <= 1e-6


@pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="a Triton kernel: CUDA or the interpreter")
@pytest.mark.parametrize("top_k, d", [(3, 100), (4, 64)])
def test_spread_rows_copies_each_token_to_its_slots(top_k: int, d: int) -> None:
    """The permutation's copy, token by token: row ``pos[t·k + j]`` of the result is token t's row, exactly the
    gather by slot (``index_select`` by ``token``), for a k that is not a power of two and rows wider than one
    column block (under the interpreter a block holds 64)."""
    from kernels.moe.permute import spread_rows

    fresh_seed()
    t, e = 37, 7
    x = torch.randn(t, d, device=DEVICE).to(torch.bfloat16)
    plan = plan_routing(torch.stack([torch.randperm(e)[:top_k] for _ in range(t)]).to(DEVICE), e)
    assert torch.equal(spread_rows(x, plan.pos, top_k), x.index_select(0, plan.token))


@pytest.mark.parametrize("backend", ["triton", TORCH_FP32])
def test_layer_saves_no_row_per_slot_of_width_d(backend: str) -> None:
    """No [T·k, d] tensor is kept for the backward: the first expert GEMM gathers its permuted input again for
    w13's gradient, and the gates scale the activations, so the expert outputs are not kept for the gates' gradient
    (at 131K tokens, top-4, d = 1024 each was 1 GiB per kept MoE layer)."""
    t, d, f, k = 20, 32, 24, 2
    layer = MoELayer(d, f, 6, k, n_shared=1, backend=backend).to(DEVICE)
    x = torch.randn(t, d, device=DEVICE, requires_grad=True)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: (shapes.append(tuple(s.shape)), s)[1], lambda s: s):
        out = layer(x)
    assert (t * k, d) not in shapes and (t, d) in shapes, shapes
    assert (t * k, 2 * f) in shapes and (t * k,) in shapes  # the SwiGLU's input and the gates in expert order
    out.sum().backward()
    assert layer.router.grad is not None and layer.router.grad.abs().sum() > 0
    shapes.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda s: (shapes.append(tuple(s.shape)), s)[1], lambda s: s):
        layer(x, keep_routed_rows=True)
    assert shapes.count((t * k, d)) == 1, shapes  # asked to: the routed rows, once, for w13's gradient


@pytest.mark.parametrize("backend", ["triton", TORCH_FP32])
def test_input_gradient_is_summed_in_place(backend: str) -> None:
    """The input's three consumers (the router and shared expert's joint GEMM, the routed experts' gather) sum its
    gradient in one buffer (``kernels.grad_sink``): the backward runs no `[T, d]` add, where autograd ran two."""
    t, d = 40, 32
    layer = MoELayer(d, 16, 6, 2, n_shared=1, backend=backend).to(DEVICE)
    x = torch.randn(t, d, device=DEVICE, requires_grad=True)
    out = layer(x * 1.0)  # a non-leaf input, as in the model
    with torch.profiler.profile(record_shapes=True) as prof:
        out.sum().backward()
    adds = [e.name for e in prof.events()
            if e.name in ("aten::add", "aten::add_") and any(list(shape) == [t, d] for shape in e.input_shapes)]
    assert adds == [] and x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("keep_routed_rows", [False, True])
@pytest.mark.parametrize("backend", ["triton", TORCH_FP32, "loop"])
def test_layer_matches_naive_fp32(backend: str, keep_routed_rows: bool) -> None:
    torch.manual_seed(1)
    layer = MoELayer(32, 16, 6, 2, n_shared=1, gate_scale=2.5, backend=backend).to(DEVICE)
    layer.balancer.bias.copy_(torch.randn(6) * 0.1)
    x = torch.randn(2, 12, 32, device=DEVICE, requires_grad=True)
    dout = torch.randn(2, 12, 32, device=DEVICE)
    params = [layer.router, layer.w13, layer.w2, layer.shared13, layer.shared2]
    out = layer(x, keep_routed_rows)
    grads = torch.autograd.grad(out, [x, *params], dout)
    ref = naive_moe(x.view(-1, 32), layer.router, layer.balancer.bias, layer.w13, layer.w2, 2, 2.5,
                    layer.shared13, layer.shared2)
    ref_grads = torch.autograd.grad(ref, [x, *params], dout.view(-1, 32))
    assert rel_err(out.view(-1, 32), ref) <= 1e-5
    for name, a, b in zip(["x", "router", "w13", "w2", "shared13", "shared2"], grads, ref_grads):
        assert rel_err(a.reshape(b.shape), b) <= 1e-5, name


@pytest.mark.parametrize("T, E, k", [(9000, 128, 5), (7, 10, 1), (33, 16, 4), (0, 8, 2)])
def test_biased_topk_matches_torch(T: int, E: int, k: int) -> None:
    """Values bit for bit and the same experts in the same order as torch.topk, fresh random scores each run."""
    scores, bias = torch.rand(T, E, device=DEVICE), torch.randn(E, device=DEVICE) * 0.1
    values, indices = biased_topk(scores, bias, k)
    want_values, want_indices = torch.topk(scores + bias, k, dim=-1, sorted=True)
    assert torch.equal(values, want_values) and torch.equal(indices, want_indices)


# ---------------------------------------------------------------- quantile balancing


def test_exact_bias_update_matches_naive() -> None:
    gen = torch.Generator().manual_seed(2)
    scores = torch.sigmoid(zipf_logits(gen, 501, 16))
    bias = torch.randn(16, generator=gen) * 0.2
    balancer = QuantileBalancer(16, 3, method="exact")
    balancer.bias.copy_(bias)
    routing = route(torch.logit(scores), torch.eye(16), balancer.bias, 3)
    balancer.observe(routing.scores, routing.alpha, routing.expert_idx)
    balancer.step()
    assert rel_err(balancer.bias, naive_bias_update(scores, bias, 3)) <= 1e-5


@pytest.mark.parametrize("n, level", [(501, 3 / 16), (64, 0.75), (17, 0.5), (2, 0.5), (1, 0.25)])
def test_exact_quantile_selects_the_linear_quantile(n: int, level: float) -> None:
    """The top-k selection (from the low end below the median, the high end above) equals torch.quantile."""
    residuals = torch.randn(n, 12, generator=torch.Generator().manual_seed(n))
    expected = torch.quantile(residuals, level, dim=0)
    assert torch.allclose(exact_quantile_bias(residuals, level), expected, atol=1e-6, rtol=0)


def test_histogram_within_resolution_of_exact() -> None:
    gen = torch.Generator().manual_seed(3)
    scores = torch.sigmoid(zipf_logits(gen, 4096, 32))
    bias = torch.randn(32, generator=gen) * 0.3
    bias -= bias.mean()
    results = {}
    for method in ("exact", "histogram"):
        balancer = QuantileBalancer(32, 4, method=method)
        balancer.bias.copy_(bias)
        observe_batch(balancer, scores)
        balancer.step()
        results[method] = balancer.bias
    width = (bias.max() - bias.min() + 2).item() / 1000
    assert (results["histogram"] - results["exact"]).abs().max().item() <= 2 * width


@pytest.mark.parametrize("balance", [True, False], ids=["balanced", "unbalanced"])
def test_zipf_router_balances_within_20_steps(balance: bool) -> None:
    balancer = QuantileBalancer(64, 8, ema=0.9, enabled=balance)
    loads = balance_run(balancer, torch.Generator().manual_seed(4), 40 if balance else 20)
    if balance:
        assert min(loads[:20]) <= 1.10, loads[:20]
        assert max(loads[20:]) <= 1.10, loads[20:]
    else:
        assert min(loads) >= 2.0, loads


def toy_train(balance: bool, steps: int) -> tuple[list[float], list[float]]:
    """Fit tanh(x A) on 16K tokens per step with E=64 learned expert outputs mixed by the gates, the
    router (starting with a Zipf preference through a constant input feature) trained by Adam at
    lr 1e-3, the expert outputs at 3e-2; returns losses and max/mean loads. (A router moving ten
    times faster, lr 1e-2, outruns a bias set from the previous step: 1.15-1.4 measured.)"""
    gen = torch.Generator().manual_seed(5)
    d, e, k = 16, 64, 8
    router = torch.randn(e, d, generator=gen) / d**0.5
    router[:, 0] = 4.0 / torch.arange(1, e + 1)
    router.requires_grad_()
    values = torch.zeros(e, d, requires_grad=True)
    teacher = torch.randn(d, d, generator=gen) / d**0.5
    balancer = QuantileBalancer(e, k, enabled=balance)
    opt = torch.optim.Adam([{"params": [router], "lr": 1e-3}, {"params": [values], "lr": 3e-2}])
    losses, loads = [], []
    for _ in range(steps):
        x = torch.randn(16384, d, generator=gen)
        x[:, 0] = 1.0
        routing = route(x, router, balancer.bias, k)
        balancer.observe(routing.scores, routing.alpha, routing.expert_idx)
        y = (routing.gates.unsqueeze(-1) * values[routing.expert_idx]).sum(1)
        loss = (y - torch.tanh(x @ teacher)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        loads.append(balancer.step().max_over_mean.item())
    return losses, loads


@pytest.mark.parametrize("balance", [True, False], ids=["balanced", "unbalanced"])
def test_trained_router_balances_and_learns(balance: bool) -> None:
    losses, loads = toy_train(balance, 35 if balance else 20)
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses
    if balance:
        assert min(loads[:20]) <= 1.10, loads[:20]
        assert max(loads[20:]) <= 1.10, loads[20:]
    else:
        assert min(loads) >= 2.0, loads


def _dp_worker(rank: int, init_file: str, out_dir: str) -> None:
    """One of two gloo ranks: half of a shared batch, one histogram bias step, save the bias; the exact
    method refuses to run on two ranks."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    scores, bias = dp_batch()
    half = scores.shape[0] // 2
    balancer = QuantileBalancer(64, 8)
    assert balancer.uses_histogram()
    balancer.bias.copy_(bias)
    mine = scores[rank * half:(rank + 1) * half]
    observe_batch(balancer, mine)
    stats = balancer.step()
    exact = QuantileBalancer(64, 8, method="exact")
    observe_batch(exact, mine)
    with pytest.raises(RuntimeError, match="needs one process"):
        exact.step()
    torch.save({"bias": balancer.bias, "load": stats.tokens_per_expert}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def dp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenated batch (scores `[8192, 64]`) and a starting bias, the same in every process."""
    gen = torch.Generator().manual_seed(6)
    bias = torch.randn(64, generator=gen) * 0.3
    return torch.sigmoid(zipf_logits(gen, 8192, 64)), bias - bias.mean()


def test_two_gloo_ranks_match_one_process(tmp_path) -> None:
    mp.spawn(_dp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    scores, bias = dp_batch()
    results = {}
    for method in ("exact", "histogram"):
        balancer = QuantileBalancer(64, 8, method=method)
        balancer.bias.copy_(bias)
        observe_batch(balancer, scores)
        stats = balancer.step()
        results[method] = (balancer.bias, stats.tokens_per_expert)
    width = (bias.max() - bias.min() + 2).item() / 1000
    assert torch.equal(ranks[0]["bias"], ranks[1]["bias"])
    assert torch.allclose(ranks[0]["bias"], results["histogram"][0], atol=1e-6)
    assert (ranks[0]["bias"] - results["exact"][0]).abs().max().item() <= 2 * width
    assert torch.equal(ranks[0]["load"], results["exact"][1])


# ---------------------------------------------------------------- module behaviour and errors


def test_bias_is_fp32_buffer_saved_and_frozen_in_eval() -> None:
    layer = MoELayer(16, 8, 8, 2).to(torch.bfloat16)
    assert layer.balancer.bias.dtype == torch.float32
    assert "balancer.bias" in layer.state_dict()
    x = torch.randn(64, 16, dtype=torch.bfloat16)
    layer.train()
    layer(x)
    stats = layer.step_balance()
    assert stats.dropped_tokens == 0 and stats.tokens_per_expert.sum().item() == 64 * 2
    trained = layer.balancer.bias.clone()
    assert trained.abs().sum() > 0
    layer.eval()
    layer(x)
    assert layer.step_balance() is None
    assert torch.equal(layer.balancer.bias, trained)
    fresh = MoELayer(16, 8, 8, 2)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh.balancer.bias, trained)


def test_checkpoint_recompute_is_observed_once() -> None:
    layer = MoELayer(16, 8, 8, 2, backend="loop")
    x = torch.randn(32, 16, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert layer.step_balance().tokens_per_expert.sum().item() == 32 * 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 8}, "top_k must be in"),
        ({"top_k": 0}, "top_k must be in"),
        ({"n_experts": 1, "top_k": 1}, "n_experts must be >= 2"),
        ({"bias_ema": 1.0}, "ema must be in"),
        ({"n_bins": 1}, "n_bins must be >= 2"),
        ({"balance_method": "median"}, "method must be one of"),
        ({"backend": "cuda"}, "backend must be one of"),
        ({"gate_scale": 0.0}, "gate_scale must be > 0"),
        ({"n_shared": -1}, "n_shared must be >= 0"),
        ({"d_expert": 0}, "d_expert must be >= 1"),
    ],
    ids=["topk-eq-E", "topk-0", "E-1", "ema-1", "bins-1", "method", "backend", "scale-0", "shared-neg", "width-0"],
)
def test_layer_argument_errors(kwargs: dict, match: str) -> None:
    args = {"d_model": 16, "d_expert": 8, "n_experts": 8, "top_k": 2} | kwargs
    with pytest.raises(ValueError, match=match):
        MoELayer(**args)


def test_function_argument_errors() -> None:
    offs = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="backend must be one of"):
        grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 8), offs, backend="fast")
    with pytest.raises(ValueError, match="offs must be int32"):
        grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 8), offs.long())
    with pytest.raises(ValueError, match="x must be"):
        grouped_mm(torch.randn(4, 7), torch.randn(2, 8, 8), offs)
    with pytest.raises(ValueError, match="top_k must be in"):
        route(torch.randn(4, 8), torch.randn(4, 8), torch.zeros(4), 4)
    with pytest.raises(ValueError, match="x must end in d_model=16"):
        MoELayer(16, 8, 8, 2)(torch.randn(3, 15))


@pytest.mark.skipif(not INTERPRET, reason="on a GPU, test_grouped_mm_uneven_bf16_gpu runs bf16 itself")
def test_grouped_mm_uneven_bf16_with_gpu_numerics(gpu_numerics: None) -> None:
    """The Triton grouped GEMM in bf16 (forward, dx, dw) under the interpreter with a GPU's bf16 arithmetic
    (tests/kernels/gpu_numerics.py): uneven groups, two of them empty, within bf16's rounding of the float32 loop."""
    counts = torch.randint(1, 40, (6,))
    counts[[1, 4]] = 0
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), 64, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(6, 64, 32) / 8).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(x.shape[0], 32, dtype=torch.bfloat16)
    out = grouped_mm(x, w, offs, backend="triton")
    grads = torch.autograd.grad(out, (x, w), dy)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = loop_grouped_mm(xf, wf, offs)
    ref_grads = torch.autograd.grad(ref, (xf, wf), dy.float())
    errors = [rel_err(out, ref), *(rel_err(a, b) for a, b in zip(grads, ref_grads))]
    assert max(errors) <= 5e-3, errors


# ---------------------------------------------------------------- GPU, real sizes, bf16


def check_layer_bf16(backend: str, d: int, d_expert: int, n_experts: int, top_k: int, n_tokens: int) -> None:
    """The bf16 layer (output and every gradient) within 1e-2 of the float32 reference on the same routing."""
    torch.manual_seed(7)
    layer = MoELayer(d, d_expert, n_experts, top_k, n_shared=1, backend=backend).to(DEVICE, torch.bfloat16)
    x = torch.randn(n_tokens, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(n_tokens, d, device=DEVICE, dtype=torch.bfloat16)
    params = [layer.router, layer.w13, layer.w2, layer.shared13, layer.shared2]
    out = layer(x)
    grads = torch.autograd.grad(out, [x, *params], dout)
    chosen = route(x, layer.router, layer.balancer.bias, top_k).expert_idx  # bf16 logits: fp32 ones flip near-ties
    ref_in = [t.detach().float().requires_grad_() for t in [x, *params]]
    ref = naive_moe(ref_in[0], ref_in[1], layer.balancer.bias, ref_in[2], ref_in[3], top_k, 1.0, ref_in[4],
                    ref_in[5], expert_idx=chosen)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.float())
    assert rel_err(out, ref) <= 1e-2
    for name, a, b in zip(["x", "router", "w13", "w2", "shared13", "shared2"], grads, ref_grads):
        assert rel_err(a, b) <= 1e-2, name


@pytest.mark.skipif(not INTERPRET, reason="on a GPU, test_layer_matches_naive_bf16_gpu runs bf16 itself")
def test_layer_matches_naive_bf16_with_gpu_numerics(gpu_numerics: None) -> None:
    """The Triton path in bf16 on the CPU (interpreter with a GPU's bf16 arithmetic, tests/kernels/gpu_numerics.py);
    measured 3.4e-3 to 4.7e-3 at this size."""
    check_layer_bf16("triton", 64, 32, 8, 2, 256)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_layer_matches_naive_bf16_gpu(backend: str) -> None:
    if backend == "torch" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no _grouped_mm")
    check_layer_bf16(backend, 2048, 1024, 64, 8, 16384)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_grouped_mm_uneven_bf16_gpu(backend: str) -> None:
    if backend == "torch" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no _grouped_mm")
    counts = torch.randint(0, 700, (64,))
    counts[[3, 40]] = 0
    offs = counts.cumsum(0).to(torch.int32).to(DEVICE)
    x = torch.randn(int(counts.sum()), 2048, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(64, 2048, 1024, device=DEVICE) / 45).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(x.shape[0], 1024, device=DEVICE, dtype=torch.bfloat16)
    out = grouped_mm(x, w, offs, backend=backend)
    grads = torch.autograd.grad(out, (x, w), dy)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = loop_grouped_mm(xf, wf, offs)
    ref_grads = torch.autograd.grad(ref, (xf, wf), dy.float())
    assert rel_err(out, ref) <= 1e-2
    for a, b in zip(grads, ref_grads):
        assert rel_err(a, b) <= 1e-2


@pytest.mark.parametrize("T, E", [(9000, 128), (33, 10), (0, 8)])
def test_residual_histogram_kernel_matches_reference(T: int, E: int) -> None:
    """The Triton histogram's counts equal the reference's exactly, residuals beyond the bins' range among them
    (clamped into the end bins), and a second batch adds into the first's counts."""
    hist = torch.zeros(E, 1000, dtype=torch.int64, device=DEVICE)
    bias = torch.randn(E, device=DEVICE) * 0.3
    want = torch.zeros_like(hist)
    for _ in range(2):
        scores = torch.rand(T, E, device=DEVICE)
        alpha = torch.rand(T, device=DEVICE) * 8.0 - 4.0
        add_residual_histogram(hist, scores, alpha, bias)
        want += residual_histogram(alpha.unsqueeze(1) - scores, bias, 1000)
    assert int(want.sum()) == 2 * T * E
    if T:  # residuals below and above the bins' range were clamped into the end bins
        assert int(want[:, 0].sum()) > 0 and int(want[:, -1].sum()) > 0
    assert torch.equal(hist, want)
