"""MoE experts in token slices (`MoELayer.slice_tokens`): the same outputs and gradients as one pass, one
balancer observation per forward, under activation checkpointing too."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import kernels.moe.layer as moe_layer
from kernels.moe import MoELayer

TOKENS, SLICE = 100, 24  # four full slices and a ragged one of 4 tokens


def layers(slice_tokens: int) -> tuple[MoELayer, MoELayer]:
    """An unsliced fp32 layer (loop backend) and a copy of it that slices above slice_tokens tokens."""
    torch.manual_seed(0)
    whole = MoELayer(16, 8, 8, 2, n_shared=1, backend="loop", slice_tokens=None)
    with torch.no_grad():
        whole.balancer.bias.uniform_(-0.1, 0.1)  # routing with a bias, as after a few steps
    sliced = copy.deepcopy(whole)
    sliced.slice_tokens = slice_tokens
    return whole, sliced


def forward_backward(layer: MoELayer, x: torch.Tensor, outer_checkpoint: bool) -> tuple[torch.Tensor, dict]:
    """Output and the gradients of x and every parameter for the loss Σ out·w (w fixed)."""
    x = x.clone().requires_grad_()
    out = checkpoint(layer, x, use_reentrant=False) if outer_checkpoint else layer(x)
    weight = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * weight).sum().backward()
    grads = {"x": x.grad} | {name: p.grad for name, p in layer.named_parameters()}
    return out.detach(), grads


@pytest.mark.parametrize("outer_checkpoint", [False, True], ids=["plain", "in-checkpointed-layer"])
def test_sliced_matches_unsliced(monkeypatch: pytest.MonkeyPatch, outer_checkpoint: bool) -> None:
    whole, sliced = layers(SLICE)
    calls = []

    def counted(fn, *args, **kwargs):  # noqa: ANN001, ANN202 - checkpoint's signature
        calls.append(args[0].shape[0])
        return checkpoint(fn, *args, **kwargs)

    x = torch.randn(4, TOKENS // 4, 16, generator=torch.Generator().manual_seed(1))
    ref_out, ref_grads = forward_backward(whole, x, outer_checkpoint)
    monkeypatch.setattr(moe_layer, "checkpoint", counted)
    out, grads = forward_backward(sliced, x, outer_checkpoint)
    assert calls[:5] == [SLICE] * 4 + [TOKENS - 4 * SLICE]  # forward; recomputes may call it again
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():  # sums over slices in another order: fp32 rounding apart
        ref = ref_grads[name]
        assert (grad - ref).norm() <= 1e-6 * ref.norm(), name
    assert torch.equal(sliced.last_load, whole.last_load)


@pytest.mark.parametrize("outer_checkpoint", [False, True], ids=["plain", "in-checkpointed-layer"])
def test_sliced_forward_is_observed_once(outer_checkpoint: bool) -> None:
    whole, sliced = layers(SLICE)
    x = torch.randn(TOKENS, 16, generator=torch.Generator().manual_seed(2))
    forward_backward(whole, x, outer_checkpoint)
    forward_backward(sliced, x, outer_checkpoint)
    ref, stats = whole.step_balance(), sliced.step_balance()
    assert stats.tokens_per_expert.sum().item() == TOKENS * 2
    assert torch.equal(stats.tokens_per_expert, ref.tokens_per_expert)
    assert torch.equal(sliced.last_load, stats.tokens_per_expert)
    # The unsliced layer takes the router's logits from one GEMM with the shared expert's input: fp32 rounding apart.
    torch.testing.assert_close(sliced.balancer.bias, whole.balancer.bias, rtol=1e-6, atol=1e-7)


def test_slice_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="slice_tokens must be >= 1"):
        MoELayer(16, 8, 8, 2, slice_tokens=0)
