"""A tensor's gradient summed in place by its consumers' backward, instead of by autograd.

When a tensor feeds several consumers, autograd gives each consumer's backward a fresh gradient buffer and adds them
up: for a ``[T, d]`` activation, one extra kernel that reads two and writes one per consumer past the first. A tensor
passed through ``sinked(x, sink)`` instead lets each consumer that knows the sink put its gradient there: the first
one to run its backward writes ``sink.grad``, every later one adds into it in its own kernel (a GEMM's epilogue with
β = 1, a gather that reads what is there), and the ``sinked`` node hands the sum to autograd once, after all of them:
they all depend on its output, so autograd runs it last. Consumers that do not know the sink return their gradient
to autograd as usual, and the node adds it. The AttnRes mixtures sum a finished block's gradient this way, and the
MoE layer its input's (the router, the shared expert and the routed experts' gather).

``ColumnSink`` is the same idea for a tensor whose column slices go to different consumers (a joint projection's
outputs): split by autograd, their gradients are concatenated in backward, a copy of the whole ``[T, N]`` gradient.
Through ``sinked_joint_linear``, a consumer that knows the sink writes its slice's gradient straight into the
sink's columns; only the others' are copied in.
"""
from __future__ import annotations

import torch

__all__ = ["GradSink", "sinked", "sinked_linear", "ColumnSink", "sinked_joint_linear"]


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


class ColumnSink:
    """The ``[T, N]`` gradient of a joint projection's output, whose column slices' consumers may write their part in
    place (``columns``) instead of returning it to autograd."""

    __slots__ = ("grad", "written", "shape")

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None
        self.written: set[int] = set()
        self.shape: tuple[int, int] | None = None

    def columns(self, start: int, stop: int, like: torch.Tensor) -> torch.Tensor:
        """The gradient's columns ``start:stop`` for a consumer's backward to fill (the buffer, like ``like``'s dtype
        and device, is allocated by the first one)."""
        if self.shape is None:
            raise RuntimeError("ColumnSink.columns: the sink belongs to no sinked_joint_linear output")
        if self.grad is None:
            self.grad = like.new_empty(self.shape)
        self.written.add(start)
        return self.grad[:, start:stop]


class SinkedJointLinear(torch.autograd.Function):
    """``(x @ wᵀ).split(sizes, 1)``, whose backward takes the output gradient from the sink (the slices it was not
    given are copied in by autograd's part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, sizes: tuple[int, ...],  # noqa: ANN001
                sink: ColumnSink) -> tuple[torch.Tensor, ...]:
        y = x @ weight.t()
        sink.shape = tuple(y.shape)
        ctx.save_for_backward(x, weight)
        ctx.sizes, ctx.sink = sizes, sink
        ctx.set_materialize_grads(False)  # a slice whose consumers all wrote into the sink gets no zeros
        return y.split(sizes, dim=1)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        x, weight = ctx.saved_tensors
        sink = ctx.sink
        dy, written, sink.grad, sink.written = sink.grad, sink.written, None, set()
        if dy is None:
            dy = x.new_empty(sink.shape)
        start = 0
        for size, grad in zip(ctx.sizes, grads):
            cols = dy[:, start:start + size]
            if grad is None:
                if start not in written:  # an output no one used
                    cols.zero_()
            elif start in written:  # a consumer that wrote into the sink and one that did not
                cols.add_(grad)
            else:
                cols.copy_(grad)
            start += size
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        return dx, (dy.t() @ x if ctx.needs_input_grad[1] else None), None, None


def sinked_joint_linear(x: torch.Tensor, weight: torch.Tensor, sizes: tuple[int, ...], sink: ColumnSink
                        ) -> tuple[torch.Tensor, ...]:
    """``F.linear(x, weight).split(sizes, dim=-1)`` (x ``[T, d]``, weight ``[Σ sizes, d]``) whose output gradient is
    ``sink``'s buffer: consumers given the sink fill their columns there (``ColumnSink.columns``), every other slice's
    gradient is copied in, and the input and weight gradients are one GEMM each over it."""
    return SinkedJointLinear.apply(x, weight, tuple(sizes), sink)
