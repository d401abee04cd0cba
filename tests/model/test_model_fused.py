"""The pieces that compile on CUDA (``vision.fusion.cuda_compiled``) and the launch-saving rewrites: each traces
whole (no graph break) and, compiled, gives the plain function's outputs and gradients; the rewrites equal what they
replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.model.attn_res import inv_rms, mix_sources
from trainer.model.fused import gated_rms_norm, joint_linear, sigmoid_gate
from trainer.model.kda import ShortConv, short_conv_silu
from trainer.model.multimodal import true_positions
from trainer.model.sequence import packed_sequence
from vision.encoder import _apply_rope


def _positions(lengths: list[int], device: str = "cpu") -> torch.Tensor:
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    return packed_sequence(cu, sum(lengths), with_mask=False, device=device).positions


def _cases(device: str, dtype: torch.dtype) -> list[tuple[str, object, tuple]]:
    """(name, fused function, arguments) at small shapes, float inputs requiring grad."""
    g = torch.Generator().manual_seed(0)

    def t(*shape: int, grad: bool = True, kind: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, kind).requires_grad_(grad)

    T, d = 70, 48
    lengths = [5, 2, 40, 23]
    sources = [t(T, d) for _ in range(3)]
    rms = [inv_rms.plain(s.detach(), 1e-6) for s in sources]
    return [
        ("short_conv", short_conv_silu, ([t(T, 16), t(T, 8)], [t(16, 4, kind=torch.float32),
                                                               t(8, 4, kind=torch.float32)], _positions(lengths, device))),
        ("inv_rms", inv_rms, (t(T, d), 1e-6)),
        ("mix", mix_sources, (sources, rms, t(d, kind=torch.float32))),
        ("gated_rms_norm", gated_rms_norm, (t(T, 2, 32), t(32, kind=torch.float32), 1e-6,
                                            t(T, 96)[:, 16:80].view(T, 2, 32))),  # a column slice, as in KDALayer
        ("sigmoid_gate", sigmoid_gate, (t(T, d), t(T, 2 * d)[:, d:])),
        ("rope", _apply_rope, (t(T, 2, 32), t(T, 2, 32), t(T, 32, grad=False, kind=torch.float32),
                               t(T, 32, grad=False, kind=torch.float32))),
    ]


def _leaves(args: tuple) -> list[torch.Tensor]:
    flat = [a for x in args for a in (x if isinstance(x, list) else [x])]
    return [a for a in flat if isinstance(a, torch.Tensor) and a.requires_grad]


def _outputs_and_grads(fn, args: tuple) -> list[torch.Tensor]:  # noqa: ANN001
    out = fn(*args)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    leaves = _leaves(args)
    loss = sum((o.float() * torch.linspace(-1, 1, o.numel(), device=o.device).view(o.shape)).sum() for o in outs)
    return [o.detach() for o in outs] + list(torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("case", range(6), ids=[c[0] for c in _cases("cpu", torch.float32)])
def test_fused_pieces_trace_whole_and_match_the_plain_functions(case: int) -> None:
    """fullgraph tracing through AOTAutograd (the front half of what inductor compiles) on the CPU."""
    name, fn, args = _cases("cpu", torch.float32)[case]
    torch._dynamo.reset()
    traced = torch.compile(fn.plain, backend="aot_eager", fullgraph=True)
    for got, want in zip(_outputs_and_grads(traced, args), _outputs_and_grads(fn.plain, args), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(6), ids=[c[0] for c in _cases("cpu", torch.float32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_pieces_match_the_plain_functions_on_cuda(case: int, dtype: torch.dtype) -> None:
    """What ``cuda_compiled`` runs (inductor) against the plain function, outputs and every gradient."""
    name, fn, args = _cases("cuda", dtype)[case]
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip(_outputs_and_grads(fn, args), _outputs_and_grads(fn.plain, args), strict=True):
        torch.testing.assert_close(got.float(), want.float(), **tol)


def _reference_conv(x: torch.Tensor, weight: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each document alone through a causal depthwise ``F.conv1d`` + SiLU (the layer's previous implementation)."""
    taps = weight.flip(1).unsqueeze(1)
    outs = [F.silu(F.conv1d(F.pad(part.t()[None], (weight.shape[1] - 1, 0)), taps, groups=x.shape[1])[0].t())
            for part in x.split(lengths)]
    return torch.cat(outs)


def test_short_conv_is_a_causal_depthwise_conv1d_per_document() -> None:
    lengths = [1, 3, 4, 50, 2, 17]
    conv = ShortConv(24, 4)
    x = torch.randn(sum(lengths), 24, requires_grad=True)
    got = conv(x, _positions(lengths))
    want = _reference_conv(x, conv.weight, lengths)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (x, conv.weight), grad), torch.autograd.grad(want, (x, conv.weight), grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_joint_linear_equals_the_separate_projections() -> None:
    layers = [torch.nn.Linear(16, n, bias=False) for n in (8, 3, 12)]
    x = torch.randn(10, 16, requires_grad=True)
    joint = joint_linear(x, *layers)
    separate = [layer(x) for layer in layers]
    grads = [torch.randn_like(s) for s in separate]
    params = [x] + [layer.weight for layer in layers]
    for got, want in zip(joint, separate, strict=True):
        torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(joint, params, grads), torch.autograd.grad(separate, params, grads)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_true_positions_is_nonzero_without_the_sync(p: float) -> None:
    mask = torch.rand(257, generator=torch.Generator().manual_seed(1)) < p
    assert torch.equal(true_positions(mask, int(mask.sum())), mask.nonzero().squeeze(1))
