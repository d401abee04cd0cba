"""A tensor's gradient summed in place by its consumers' backward, instead of by autograd.

When a tensor feeds several consumers, autograd gives each consumer's backward a fresh gradient buffer and adds them
up: for a ``[T, d]`` activation, one extra kernel that reads two and writes one per consumer past the first. A tensor
passed through ``sinked(x, sink)`` instead lets each consumer that knows the sink put its gradient there: the first
one to run its backward writes ``sink.grad``, every later one adds into it in its own kernel (a GEMM's epilogue with
β = 1, a gather that reads what is there), and the ``sinked`` node hands the sum to autograd once, after all of them:
they all depend on its output, so autograd runs it last. Consumers that do not know the sink return their gradient
to autograd as usual, and the node adds it. The AttnRes mixtures sum a finished block's gradient this way, and the
MoE layer its input's (the router, the shared expert and the routed experts' gather).
"""
from __future__ import annotations

import torch

__all__ = ["GradSink", "sinked", "sinked_linear"]


class GradSink:
    """The gradient of one tensor that several consumers read, summed in place by their backward."""

    __slots__ = ("grad",)

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None

    def add_mm(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Adds ``a @ b`` to the sum: a GEMM into it (β = 1), or the sum's first term."""
        if self.grad is None:
            self.grad = a @ b
        else:
            self.grad.addmm_(a, b)


class Sinked(torch.autograd.Function):
    """Identity forward; backward hands on ``sink.grad`` (plus whatever reached it through autograd) once every
    consumer's backward has added into it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sink: GradSink) -> torch.Tensor:  # noqa: ANN001
        ctx.sink = sink
        ctx.set_materialize_grads(False)  # consumers that added into the sink give autograd nothing: no zeros
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:  # noqa: ANN001
        total, ctx.sink.grad = ctx.sink.grad, None
        if total is None or grad is None:
            return (grad if total is None else total), None
        return total + grad, None


def sinked(x: torch.Tensor, sink: GradSink) -> torch.Tensor:
    """x, whose gradient from the consumers given ``sink`` is summed there (see the module docstring); any other
    consumer's gradient still flows through autograd."""
    return Sinked.apply(x, sink)


class SinkedLinear(torch.autograd.Function):
    """``x @ wᵀ`` whose input gradient ``dy @ w`` goes into the sink."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, sink: GradSink) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, weight)
        ctx.sink = sink
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[None, torch.Tensor | None, None]:  # noqa: ANN001
        x, weight = ctx.saved_tensors
        if ctx.needs_input_grad[0]:
            ctx.sink.add_mm(dy, weight)
        return None, (dy.t() @ x if ctx.needs_input_grad[1] else None), None


def sinked_linear(x: torch.Tensor, weight: torch.Tensor, sink: GradSink) -> torch.Tensor:
    """``F.linear(x, weight)`` (x ``[T, d]``, weight ``[N, d]``, no bias) for x ``sinked`` with ``sink``: its
    gradient is added into the sink."""
    return SinkedLinear.apply(x, weight, sink)
