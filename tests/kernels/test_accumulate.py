"""The float32 gradient sum's add kernel against PyTorch's in-place add: the same float32 additions, so equal bit for
bit, on fresh random inputs of sizes around the kernel's block and its minimum (below it, the reference's path)."""
from __future__ import annotations

import pytest
import torch

from checks import fresh_seed
from interpreted import import_interpreted

import_interpreted("kernels.accumulate")

from kernels.accumulate import add_into, naive_add_into  # noqa: E402
from kernels.accumulate.add import KERNEL_MIN  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n", [1, 4095, KERNEL_MIN, KERNEL_MIN + 4096 * 3 + 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_the_in_place_add(n: int, dtype: torch.dtype) -> None:
    fresh_seed()
    acc = torch.randn(n, device=DEVICE) * 100
    x = torch.randn(n, device=DEVICE).to(dtype)
    expected = naive_add_into(acc.clone(), x)
    got = acc.clone()
    assert add_into(got, x) is got
    assert torch.equal(got, expected) and not torch.equal(got, acc)


def test_shapes_differ_but_sizes_agree_and_strides_fall_back() -> None:
    """A gradient is added by element count (DeepSpeed's float32 sums may be flat); a transposed x takes the
    reference's path and gives the same sum."""
    fresh_seed()
    acc = torch.randn(6, 40, device=DEVICE)
    x = torch.randn(40, 6, device=DEVICE).bfloat16()
    assert torch.equal(add_into(acc.clone().view(-1), x), naive_add_into(acc.clone().view(-1), x))
    xt = torch.randn(40, 6, device=DEVICE).bfloat16().t()
    assert torch.equal(add_into(acc.clone(), xt), acc + xt.float())


def test_refuses_a_sum_that_is_not_float32_or_another_size() -> None:
    with pytest.raises(ValueError, match="float32"):
        add_into(torch.zeros(4, dtype=torch.bfloat16, device=DEVICE), torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="5 elements"):
        add_into(torch.zeros(4, device=DEVICE), torch.zeros(5, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_at_an_expert_weights_size() -> None:
    """128 experts × 1,024 × 448 (``small``'s gate and up projections, 58.7 M elements), bit for bit."""
    fresh_seed()
    acc = torch.randn(128 * 1024 * 448, device="cuda")
    x = torch.randn_like(acc).bfloat16()
    assert torch.equal(add_into(acc.clone(), x), naive_add_into(acc.clone(), x))
