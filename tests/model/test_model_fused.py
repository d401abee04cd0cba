"""The pieces that compile on CUDA (``vision.fusion.cuda_compiled``) and the launch-saving rewrites: each traces
whole (no graph break) and, compiled, gives the plain function's outputs and gradients; the rewrites equal what they
replace."""
from __future__ import annotations

import pytest
import torch

from kernels.attn_res import GradSink, sinked
from trainer.model.attn_res import SinkedAdd, add_inv_rms, add_inv_rms_bwd, inv_rms
from trainer.model.multimodal import cross_entropy_chunk
from trainer.model.fused import gated_rms_norm, joint_linear, sigmoid_gate
from vision.encoder import _apply_rope, _attention_inputs, _block_output


def _cases(device: str, dtype: torch.dtype) -> list[tuple[str, object, tuple]]:
    """(name, fused function, arguments) at small shapes, float inputs requiring grad."""
    g = torch.Generator().manual_seed(0)

    def t(*shape: int, grad: bool = True, kind: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, kind).requires_grad_(grad)

    T, d = 70, 48
    return [
        ("inv_rms", inv_rms, (t(T, d), 1e-6)),
        ("add_inv_rms", add_inv_rms, (t(T, d), t(T, d), 1e-6)),
        ("add_inv_rms_bwd", add_inv_rms_bwd,
         (t(T, d), t(T, kind=torch.float32), t(T, d), t(T, kind=torch.float32))),
        ("gated_rms_norm", gated_rms_norm, (t(T, 2, 32), t(32, kind=torch.float32), 1e-6,
                                            t(T, 96)[:, 16:80].view(T, 2, 32))),  # a column slice, as in KDALayer
        ("sigmoid_gate", sigmoid_gate, (t(T, d), t(T, 2 * d)[:, d:])),
        ("cross_entropy_chunk", cross_entropy_chunk, (t(T, 40), torch.randint(0, 40, (T,), generator=g).to(device),
                                                       True)),
        ("rope", _apply_rope, (t(T, 2, 32), t(T, 2, 32), t(T, 32, grad=False, kind=torch.float32),
                               t(T, 32, grad=False, kind=torch.float32))),
        ("vision_attention_inputs", _attention_inputs,
         (t(T, d), t(d), t(d), 1e-6, t(3 * d, d), t(3 * d), t(T, 24, grad=False, kind=torch.float32),
          t(T, 24, grad=False, kind=torch.float32), 2)),
        ("vision_block_output", _block_output,
         (t(T, d), t(1, 2, T, 24), t(d, d), t(d), t(d), t(d), 1e-6, t(4 * d, d), t(4 * d), t(d, 4 * d), t(d))),
    ]


CASE_IDS = [c[0] for c in _cases("cpu", torch.float32)]


def _leaves(args: tuple) -> list[torch.Tensor]:
    flat = [a for x in args for a in (x if isinstance(x, list) else [x])]
    return [a for a in flat if isinstance(a, torch.Tensor) and a.requires_grad]


def _outputs_and_grads(fn, args: tuple) -> list[torch.Tensor]:  # noqa: ANN001
    out = fn(*args)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    leaves = _leaves(args)
    loss = sum((o.float() * torch.linspace(-1, 1, o.numel(), device=o.device).view(o.shape)).sum() for o in outs)
    return [o.detach() for o in outs] + list(torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
def test_fused_pieces_trace_whole_and_match_the_plain_functions(case: int) -> None:
    """fullgraph tracing through AOTAutograd (the front half of what inductor compiles) on the CPU."""
    name, fn, args = _cases("cpu", torch.float32)[case]
    torch._dynamo.reset()
    traced = torch.compile(fn.plain, backend="aot_eager", fullgraph=True)
    for got, want in zip(_outputs_and_grads(traced, args), _outputs_and_grads(fn.plain, args), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_pieces_match_the_plain_functions_on_cuda(case: int, dtype: torch.dtype) -> None:
    """What ``cuda_compiled`` runs (inductor) against the plain function, outputs and every gradient. In bf16 the
    compiled piece keeps float32 between its ops where the plain one rounds after each, so both are measured against
    the plain function on the same inputs in float32: the compiled error must not exceed the plain one's (×2). In
    float32 the absolute tolerance scales with each tensor's largest entry: the tower's pieces reach hundreds on
    these inputs, and summing in another order moves their small, cancelling entries by more than a fixed 1e-5."""
    name, fn, args = _cases("cuda", dtype)[case]
    got_all, want_all = _outputs_and_grads(fn, args), _outputs_and_grads(fn.plain, args)
    if dtype == torch.float32:
        for got, want in zip(got_all, want_all, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * max(1.0, want.abs().max().item()))
        return

    def upcast(x):  # noqa: ANN001, ANN202
        if isinstance(x, list):
            return [upcast(a) for a in x]
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().float().requires_grad_(x.requires_grad)
        return x

    refs = _outputs_and_grads(fn.plain, tuple(upcast(a) for a in args))
    for got, want, ref in zip(got_all, want_all, refs, strict=True):
        err_got, err_want = (got.float() - ref).norm(), (want.float() - ref).norm()
        assert err_got <= 2 * err_want + 1e-3 * ref.norm(), (name, err_got.item(), err_want.item())


def test_joint_linear_equals_the_separate_layers() -> None:
    """One GEMM gives each layer's output, a grouped part its layers' outputs side by side; gradients too."""
    torch.manual_seed(0)
    x = torch.randn(10, 12, requires_grad=True)
    layers = [torch.nn.Linear(12, n, bias=False) for n in (4, 6, 3, 5)]
    joint = joint_linear(x, (layers[0], layers[1]), layers[2], layers[3])
    assert [tuple(o.shape) for o in joint] == [(10, 10), (10, 3), (10, 5)]
    separate = [torch.cat([layers[0](x), layers[1](x)], dim=1), layers[2](x), layers[3](x)]
    grads = [torch.randn_like(o) for o in separate]
    got = torch.autograd.grad(joint, [x, *(layer.weight for layer in layers)], grads)
    want = torch.autograd.grad(separate, [x, *(layer.weight for layer in layers)], grads)
    for a, b in zip(joint, separate, strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_sinked_add_matches_autograd_through_add_inv_rms() -> None:
    """``SinkedAdd``'s backward (by hand, x's gradient handed over through the sink to x's other reader, which runs
    backward after it as the next mixture does; both read x through the sink) against autograd through
    ``add_inv_rms``, in float64."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, 48, generator=g, dtype=torch.float64, requires_grad=True)
    a, w = (torch.randn(70, 48, generator=g, dtype=torch.float64) for _ in range(2))

    def loss(x_read: torch.Tensor, add) -> torch.Tensor:  # noqa: ANN001 - y reads x, as a sublayer its mixture
        total, rms = add(x_read, torch.tanh(a * x_read))
        return (total * w).sum() + (rms * rms).sum()

    want = torch.autograd.grad(loss(x, lambda p, q: add_inv_rms(p, q, 1e-6)), x)[0]
    sink = GradSink()
    got = torch.autograd.grad(loss(sinked(x, sink), lambda p, q: SinkedAdd.apply(p, q, sink, 1e-6)), x)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert sink.grad is None  # handed on by the Sinked node, which ran last
