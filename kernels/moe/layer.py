"""The MoE FFN module: sigmoid router + quantile-balanced bias, routed SwiGLU experts through the
grouped GEMM, shared expert(s) beside them. Dropless: every routed (token, expert) pair is computed.

Long sequences run the experts in token slices, each under its own activation checkpoint: the routed rows are
k copies of the tokens (at 1M tokens × 1024 in bf16, 8 GiB each for the sorted input, the expert output and their
gradients), and sliced they exist for one slice at a time, in the forward and in the backward."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels.grad_sink import GradSink, sinked, sinked_linear

from .balance import Method, QuantileBalancer
from .grouped_gemm import BACKENDS, Backend, _grouped_mm, resolve_backend
from .permute import RoutingPlan, combine, expert_counts, plan_routing, spread_grouped_mm
from .router import _route, route_logits
from .stats import LoadStats
from .swiglu import swiglu


def recomputing() -> bool:
    """True while autograd's backward runs this forward again (activation checkpointing): the
    step's tokens were already observed, and counting them twice would double the load."""
    return torch._C._current_graph_task_id() != -1


def moe_experts(tokens: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, plan: RoutingPlan,
                row_gates: torch.Tensor, backend: str, keep_rows: bool = False, sink: GradSink | None = None
                ) -> torch.Tensor:
    """Routed SwiGLU experts of tokens `[T, d]`, one row per (token, slot) in expert order, each row's output times
    its gate: w13 `[E, d, 2F]`, w2 `[E, F, d]`, row_gates fp32 `[T·k]` (expert order) -> `[T·k, d]`.

    Unless ``keep_rows``, neither `[T·k, d]` tensor is kept for the backward: the first GEMM reads the tokens through
    the permutation and gathers them again for its weight gradient (``spread_grouped_mm``), and the gate scales the
    activation `[T·k, F]` before the down projection rather than its output after it (the same product; the gate's
    gradient comes from the activation the SwiGLU recomputes anyway). ``sink``: the one tokens were ``sinked``
    with, where their gradient is summed."""
    hidden = swiglu(spread_grouped_mm(tokens, w13, plan, backend, keep_rows, sink), backend, scale=row_gates)
    return _grouped_mm(hidden, w2, plan.offs, backend)


class MoELayer(nn.Module):
    """MoE FFN. forward(x `[..., d_model]`) -> `[..., d_model]`, same dtype.

    Parameters: `router` `[E, d]`, `w13` `[E, d, 2F]` (gate | up), `w2` `[E, F, d]`, and for
    `n_shared > 0` one wide shared SwiGLU `shared13` `[d, 2·n_shared·F]`, `shared2` `[n_shared·F, d]`
    (n_shared experts of width F summed equal one of width n_shared·F). The routing bias lives in
    `balancer.bias` (fp32 buffer). In training each forward is observed (not its recomputation under
    activation checkpointing); call `step_balance()` once
    per optimizer step to update the bias and get that step's `LoadStats`. `last_load` holds the
    tokens per expert `[E]` of the latest forward.

    Above `slice_tokens` tokens (None: never) the experts run in slices of that many tokens, each checkpointed
    (only its inputs saved, its routed rows recomputed in the backward). Routing stays global, so the
    balancer observes every token of the forward at once; outputs and gradients equal the unsliced ones.

    `forward(x, keep_routed_rows=True)` keeps the routed rows `[T·k, d]` from the forward to the backward instead of
    gathering them again for the experts' weight gradient: for a layer under activation checkpointing, where they
    live only from its recompute to its backward (the decoder passes it for those), or where memory is to spare.
    The slices do not (the 1M-token step's peak is what they are for).

    Unsliced, the router and the shared expert's up projection are one GEMM, and the input's gradient is summed in
    place (``kernels.grad_sink``): that GEMM's backward and the routed experts' gather-sum add into one buffer, where
    autograd would add three `[T, d]` gradients with two more kernels.
    """

    def __init__(
        self,
        d_model: int,
        d_expert: int,
        n_experts: int,
        top_k: int,
        *,
        n_shared: int = 1,
        gate_scale: float = 1.0,
        balance: bool = True,
        bias_ema: float = 0.0,
        n_bins: int = 1000,
        balance_method: Method = "auto",
        process_group: dist.ProcessGroup | None = None,
        backend: Backend = "auto",
        slice_tokens: int | None = 131072,
    ) -> None:
        super().__init__()
        if d_model < 1:
            raise ValueError(f"d_model must be >= 1, got {d_model}")
        if d_expert < 1:
            raise ValueError(f"d_expert must be >= 1, got {d_expert}")
        if n_shared < 0:
            raise ValueError(f"n_shared must be >= 0, got {n_shared}")
        if not gate_scale > 0:
            raise ValueError(f"gate_scale must be > 0, got {gate_scale}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if slice_tokens is not None and slice_tokens < 1:
            raise ValueError(f"slice_tokens must be >= 1 or None, got {slice_tokens}")
        self.balancer = QuantileBalancer(
            n_experts, top_k, ema=bias_ema, n_bins=n_bins, method=balance_method,
            process_group=process_group, enabled=balance,
        )
        self.d_model, self.d_expert, self.n_experts, self.top_k = d_model, d_expert, n_experts, top_k
        self.n_shared, self.gate_scale, self.backend, self.slice_tokens = n_shared, gate_scale, backend, slice_tokens
        self.router = nn.Parameter(torch.empty(n_experts, d_model))
        self.w13 = nn.Parameter(torch.empty(n_experts, d_model, 2 * d_expert))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        d_shared = n_shared * d_expert
        self.shared13 = nn.Parameter(torch.empty(d_model, 2 * d_shared)) if n_shared else None
        self.shared2 = nn.Parameter(torch.empty(d_shared, d_model)) if n_shared else None
        self.last_load: torch.Tensor | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal init with std 1/sqrt(fan_in) (unit-variance activations); the bias back to 0."""
        nn.init.normal_(self.router, std=1.0 / math.sqrt(self.d_model))
        nn.init.normal_(self.w13, std=1.0 / math.sqrt(self.d_model))
        nn.init.normal_(self.w2, std=1.0 / math.sqrt(self.d_expert))
        if self.shared13 is not None:
            nn.init.normal_(self.shared13, std=1.0 / math.sqrt(self.d_model))
            nn.init.normal_(self.shared2, std=1.0 / math.sqrt(self.shared2.shape[0]))
        self.balancer.bias.zero_()

    def forward(self, x: torch.Tensor, keep_routed_rows: bool = False) -> torch.Tensor:
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x must end in d_model={self.d_model}, got shape {tuple(x.shape)}")
        tokens = x.reshape(-1, self.d_model)
        size = self.slice_tokens
        whole = size is None or tokens.shape[0] <= size
        sink = shared_in = None
        if whole:  # the router's logits and the shared expert's input from one GEMM
            if tokens.requires_grad and torch.is_grad_enabled():
                sink = GradSink()
                tokens = sinked(tokens, sink)
            weight = self.router if self.shared13 is None else torch.cat([self.router, self.shared13.t()])
            joint = F.linear(tokens, weight) if sink is None else sinked_linear(tokens, weight, sink)
            logits, shared_in = (joint, None) if self.shared13 is None else joint.split(
                [self.n_experts, self.shared13.shape[1]], dim=1)
            routing = route_logits(logits, self.balancer.bias, self.top_k, self.gate_scale)
        else:
            routing = _route(tokens, self.router, self.balancer.bias, self.top_k, self.gate_scale)
        if self.training and not recomputing():
            self.balancer.observe(routing.scores, routing.alpha, routing.expert_idx)
        backend = resolve_backend(self.backend, tokens)
        if whole:
            plan = plan_routing(routing.expert_idx, self.n_experts)
            self.last_load = plan.counts
            out = self._experts(tokens, routing.gates, plan, backend, keep_routed_rows, shared_in, sink)
        else:
            self.last_load = expert_counts(routing.expert_idx, self.n_experts)
            pieces = zip(tokens.split(size), routing.gates.split(size), routing.expert_idx.split(size))
            out = torch.cat([checkpoint(self._slice, *piece, backend, use_reentrant=False) for piece in pieces])
        return out.view(x.shape)

    def _slice(self, tokens: torch.Tensor, gates: torch.Tensor, expert_idx: torch.Tensor, backend: str
               ) -> torch.Tensor:
        """One slice of tokens `[T, d]` with its gates and experts `[T, k]`: its own routing plan and experts, so
        one checkpointed call holds every per-token buffer after the router."""
        return self._experts(tokens, gates, plan_routing(expert_idx, self.n_experts), backend, keep_rows=False)

    def _experts(self, tokens: torch.Tensor, gates: torch.Tensor, plan: RoutingPlan, backend: str, keep_rows: bool,
                 shared_in: torch.Tensor | None = None, sink: GradSink | None = None) -> torch.Tensor:
        """Routed plus shared experts of tokens `[T, d]`, their gates `[T, k]` and routing plan; ``shared_in``: the
        shared expert's up projection when already computed, ``sink``: the one tokens were ``sinked`` with."""
        row_gates = gates.reshape(-1).index_select(0, plan.order)  # expert order, as the rows
        y = moe_experts(tokens, self.w13, self.w2, plan, row_gates, backend, keep_rows, sink)
        out = combine(y, plan, backend)
        if self.shared13 is not None:  # the sum in the down projection's epilogue: no [T, d] add of its own
            shared_in = tokens @ self.shared13 if shared_in is None else shared_in
            out = torch.addmm(out, swiglu(shared_in, backend), self.shared2)
        return out

    def step_balance(self) -> LoadStats | None:
        """Once per optimizer step: update the routing bias (when `balance`) from the forwards observed
        since the last call and return their load (None when nothing was observed, e.g. in eval)."""
        return self.balancer.step()

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_expert={self.d_expert}, n_experts={self.n_experts}, "
                f"top_k={self.top_k}, n_shared={self.n_shared}, backend={self.backend!r}, "
                f"slice_tokens={self.slice_tokens}")


def step_moe_balance(model: nn.Module) -> list[LoadStats]:
    """Step the bias of every MoELayer in model (call after each optimizer step); returns their loads."""
    stats = [m.step_balance() for m in model.modules() if isinstance(m, MoELayer)]
    return [s for s in stats if s is not None]
