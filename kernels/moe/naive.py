"""Plain-PyTorch references for the MoE layer, written for clarity (per token, per expert).

Everything here is the definition the kernels are checked against: no sorting, no grouped GEMM,
the gates scattered back with `index_add_`, and the bias update with a per-expert sort.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_swiglu_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: x `[n, d]`, w13 `[d, 2F]` (gate columns first), w2 `[F, d]` -> `[n, d]`."""
    gate, up = (x @ w13).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2


def naive_route(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, gate_scale: float,
    expert_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts and gates per token: top_k of `s + b`, gates = chosen `s` normalised, times gate_scale.
    x `[T, d]`, weight `[E, d]`, bias `[E]` -> expert_idx int64 `[T, k]`, gates fp32 `[T, k]`.
    A given expert_idx replaces the choice (an fp32 reference of a bf16 run: near-ties flip)."""
    scores = torch.sigmoid((x @ weight.t()).float())
    if expert_idx is None:
        expert_idx = torch.topk(scores.detach() + bias, top_k, dim=-1).indices
    picked = scores.gather(1, expert_idx)
    return expert_idx, gate_scale * picked / picked.sum(-1, keepdim=True)


def naive_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    bias: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    gate_scale: float = 1.0,
    shared13: torch.Tensor | None = None,
    shared2: torch.Tensor | None = None,
    expert_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """MoE FFN by a loop over experts. x `[T, d]`, router_weight `[E, d]`, bias `[E]`,
    w13 `[E, d, 2F]`, w2 `[E, F, d]`, optional shared expert shared13 `[d, 2Fs]`, shared2 `[Fs, d]`,
    optional fixed routing expert_idx `[T, k]`. Returns `[T, d]`."""
    expert_idx, gates = naive_route(x, router_weight, bias, top_k, gate_scale, expert_idx)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, slot = torch.nonzero(expert_idx == e, as_tuple=True)
        y = naive_swiglu_expert(x[token], w13[e], w2[e])
        out = out.index_add(0, token, y * gates[token, slot].unsqueeze(1).to(y.dtype))
    if shared13 is not None:
        out = out + naive_swiglu_expert(x, shared13, shared2)
    return out


def naive_bias_update(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """One quantile-balancing step on scores `[T, E]` with bias `[E]` -> new bias `[E]` (mean 0).

    α_i = (k+1)-th largest of s_i + b; r_ij = α_i − s_ij; b_j = linear k/E quantile of r_·j."""
    n_tokens, n_experts = scores.shape
    alpha = (scores + bias).sort(dim=1, descending=True).values[:, top_k]
    rank = top_k / n_experts * (n_tokens - 1)
    below = int(rank)
    new = torch.empty(n_experts, dtype=torch.float64)
    for j in range(n_experts):
        r = sorted((alpha - scores[:, j]).double().tolist())
        new[j] = r[below] + (rank - below) * (r[min(below + 1, n_tokens - 1)] - r[below])
    return (new - new.mean()).float()
