"""Quantile balancing: the per-expert routing bias, set from statistics instead of an auxiliary loss.

With `α_i` the (k+1)-th largest `s_i· + b`, token i takes expert j exactly when `s_ij + b_j > α_i`,
i.e. when `b_j > r_ij = α_i − s_ij`. Choosing `b_j` as the k/E quantile of `r_·j` over the step's
tokens therefore gives every expert the share k/E of them: `b_j ← quantile_i(r_ij, k/E)`, then
`b ← b − mean(b)` (only differences of b matter).

Within one process the quantile is exact. Across data-parallel ranks each rank bins its `r` into
a histogram that is summed by one all-reduce. The bins need no agreement step: since `s ∈ (0, 1)`
and `α_i` is some `s_ij + b_j`, every `r_ij` lies in `[min(b) − 1, max(b) + 1]`, and b is the same
on every rank, so each rank derives the same `n_bins` bins over that range from its own b.
The histogram quantile is within one bin width `(max(b) − min(b) + 2) / n_bins` of the exact one.

Optional EMA (`ema > 0`): b is the bias-corrected exponential average of the per-step targets
(as Adam corrects its moments), so the first step still jumps to the target while later steps
average out the sampling noise of one batch's quantile (measured in tests/kernels/test_moe.py:
at 16K tokens, E=64, k=8, ema=0.9 keeps max/mean load near 1.08 where ema=0 peaks near 1.13).
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from .histogram import add_residual_histogram, histogram_bins
from .permute import expert_counts
from .stats import LoadStats

Method = Literal["auto", "exact", "histogram"]
METHODS: tuple[str, ...] = ("auto", "exact", "histogram")


def exact_quantile_bias(residuals: torch.Tensor, level: float) -> torch.Tensor:
    """Per-expert `level` quantile (linear interpolation at rank `level · (N − 1)`) of residuals
    `[N, E]` -> `[E]`. Only the two order statistics around that rank are selected (a top-k of about
    `level · N` per expert, from whichever end is nearer), not a full sort; nor `torch.quantile`,
    which refuses more than 2^24 elements."""
    n = residuals.shape[0]
    rank = level * (n - 1)
    below = int(rank)
    above = min(below + 1, n - 1)
    per_expert = residuals.t()
    if above < n // 2:
        ordered = per_expert.topk(above + 1, dim=1, largest=False, sorted=True).values
        lo, hi = ordered[:, below], ordered[:, above]
    else:  # descending: order statistic i sits at n - 1 - i
        ordered = per_expert.topk(n - below, dim=1, largest=True, sorted=True).values
        lo, hi = ordered[:, n - 1 - below], ordered[:, n - 1 - above]
    return lo + (rank - below) * (hi - lo)


def histogram_quantile_bias(hist: torch.Tensor, bias: torch.Tensor, level: float) -> torch.Tensor:
    """Per-expert `level` quantile from counts `[E, n_bins]`, interpolated inside the bin -> `[E]`.

    Uses the rank `level · (N − 1)` of the N samples, as the exact linear quantile does.
    """
    n_bins = hist.shape[1]
    lo, width = histogram_bins(bias, n_bins)
    cum = torch.cumsum(hist, dim=1)
    rank = level * (cum[:, -1:].double() - 1.0)
    b = torch.searchsorted(cum.double(), rank, right=True).clamp_(max=n_bins - 1)
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)), 0).double()
    inside = hist.gather(1, b).double().clamp(min=1.0)
    frac = ((rank - before + 0.5) / inside).clamp(0.0, 1.0)
    return (lo + width * (b.double() + frac)).squeeze(1).float()


class QuantileBalancer(nn.Module):
    """Holds the routing bias (fp32 buffer `bias` `[E]`, saved in the state dict) and updates it.

    `observe(...)` once per forward in training (micro-batches accumulate), then `step()` once per
    optimizer step: it sets the bias from everything observed since the last step and returns that
    step's load. Observing nothing (eval) leaves the bias frozen.
    """

    def __init__(
        self,
        n_experts: int,
        top_k: int,
        *,
        ema: float = 0.0,
        n_bins: int = 1000,
        method: Method = "auto",
        process_group: dist.ProcessGroup | None = None,
        enabled: bool = True,
    ) -> None:
        super().__init__()
        if n_experts < 2:
            raise ValueError(f"n_experts must be >= 2, got {n_experts}")
        if not 1 <= top_k < n_experts:
            raise ValueError(f"top_k must be in [1, {n_experts}), got {top_k}")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        if n_bins < 2:
            raise ValueError(f"n_bins must be >= 2, got {n_bins}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.n_experts, self.top_k, self.ema, self.n_bins = n_experts, top_k, ema, n_bins
        self.method, self.process_group, self.enabled = method, process_group, enabled
        self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32))
        self.register_buffer("ema_target", torch.zeros(n_experts, dtype=torch.float32))
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))
        self._residuals: list[torch.Tensor] = []
        self._hist: torch.Tensor | None = None
        self._load: torch.Tensor | None = None

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        """Keep the bias state fp32 through `.to(bf16)` / `.half()`: only its device may change."""
        kept = {name: self._buffers[name] for name in ("bias", "ema_target")}
        super()._apply(fn, recurse)
        for name, value in kept.items():
            self._buffers[name] = value.to(device=self._buffers[name].device, dtype=torch.float32)
        return self

    def world_size(self) -> int:
        """Ranks of the process group (1 without torch.distributed)."""
        return dist.get_world_size(self.process_group) if dist.is_available() and dist.is_initialized() else 1

    def uses_histogram(self) -> bool:
        """Histogram when asked, or (auto) when the process group has more than one rank."""
        if self.method != "auto":
            return self.method == "histogram"
        return self.world_size() > 1

    @torch.no_grad()
    def observe(self, scores: torch.Tensor, alpha: torch.Tensor, expert_idx: torch.Tensor) -> None:
        """Record one forward: scores fp32 `[T, E]`, alpha fp32 `[T]`, expert_idx int64 `[T, k]`."""
        load = expert_counts(expert_idx, self.n_experts)
        self._load = load if self._load is None else self._load + load
        if not self.enabled:
            return
        if self.uses_histogram():
            if self._hist is None:
                self._hist = torch.zeros(self.n_experts, self.n_bins, dtype=torch.int64, device=scores.device)
            add_residual_histogram(self._hist, scores, alpha, self.bias)
        else:
            self._residuals.append(alpha.unsqueeze(1) - scores)

    @torch.no_grad()
    def step(self) -> LoadStats | None:
        """Update the bias from the observed tokens, reset, and return the step's load (None if none)."""
        if self._load is None:
            return None
        load, hist, residuals = self._load, self._hist, self._residuals
        self._load, self._hist, self._residuals = None, None, []
        world = self.world_size()
        if world > 1:
            if self.enabled and hist is None:
                raise RuntimeError(f"method='exact' needs one process (ranks would disagree on b), got {world} ranks")
            packed = torch.cat([load.unsqueeze(1), hist], 1) if hist is not None else load.unsqueeze(1)
            dist.all_reduce(packed, group=self.process_group)
            load, hist = packed[:, 0], (packed[:, 1:] if hist is not None else None)
        if self.enabled:
            level = self.top_k / self.n_experts
            if hist is not None:
                target = histogram_quantile_bias(hist, self.bias, level)
            else:
                target = exact_quantile_bias(torch.cat(residuals), level)
            self.updates += 1
            self.ema_target.mul_(self.ema).add_(target - target.mean(), alpha=1.0 - self.ema)
            self.bias.copy_(self.ema_target / (1.0 - self.ema ** self.updates.double()))
        return LoadStats.from_counts(load)
