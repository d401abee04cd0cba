"""Document attention's backends: the masks each builds, the errors for a backend that does not exist, and on the GPU
the varlen flash kernels and FlexAttention against the per-segment reference, forward and gradients."""
from __future__ import annotations

import pytest
import torch

from vision.attention import (BACKENDS, backend_for, cuda_backend, document_attention, document_mask,
                              flex_kernel_options)


def test_varlen_mask_carries_device_bounds_and_the_longest_segment() -> None:
    cu = torch.tensor([0, 5, 305, 306, 306, 506], dtype=torch.int64)
    mask = document_mask(cu, 506, causal=True, backend="varlen", device="cpu")
    assert mask.block_mask is None and mask.bounds == ()
    assert mask.cu_seqlens.dtype == torch.int32 and mask.cu_seqlens.tolist() == cu.tolist()
    assert mask.max_length == 300 and mask.length == 506


def test_unknown_backends_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="backend must be varlen, flex or segments, got 'dense'"):
        document_mask(cu, 4, causal=True, backend="dense", device="cpu")
    monkeypatch.setenv("LONGWEAVE_ATTENTION", "sdpa")
    with pytest.raises(ValueError, match=r"LONGWEAVE_ATTENTION: must be one of \('varlen', 'flex', 'varlen/flex', "
                                         r"'flex/varlen'\), got 'sdpa'"):
        cuda_backend()
    monkeypatch.setenv("LONGWEAVE_ATTENTION", "flex")
    assert cuda_backend() == "flex" and backend_for(causal=True) == backend_for(causal=False) == "flex"
    monkeypatch.setenv("LONGWEAVE_ATTENTION", "flex/varlen")  # the decoder's causal masks, then the vision tower's
    assert backend_for(causal=True) == "flex" and backend_for(causal=False) == "varlen"
    monkeypatch.delenv("LONGWEAVE_ATTENTION")
    assert cuda_backend() == "flex/varlen"   # the stage's faster pair on the H100 (DEFAULT_CUDA_BACKEND)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_gpu_backends_match_the_segment_reference(backend: str, causal: bool) -> None:
    """bf16 q, k, v ``[T, H, D]`` as the MLA layer hands them over (column slices of one joint projection, so rows
    are strided) viewed ``[1, H, T, D]``; random segment lengths, empty and one-token ones among them; output and
    the joint buffer's gradient within bf16 rounding of the float32 per-segment path."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    lengths = [0, 1, *torch.randint(2, 1500, (6,), generator=gen).tolist(), 129]
    T, H, D = sum(lengths), 4, 128
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    joint = torch.randn(T, 3 * H * D + 64, generator=gen).cuda()
    dy = torch.randn(T, H, D, generator=gen).cuda()

    def run(mask, dtype: torch.dtype) -> list[torch.Tensor]:  # noqa: ANN001
        leaf = joint.to(dtype).detach().requires_grad_()  # a new leaf: at joint's dtype, .to is joint itself
        q, k, v = (leaf[:, i * H * D:(i + 1) * H * D].view(T, H, D) for i in range(3))
        out = document_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), mask, scale=D ** -0.5)
        out = out[0].transpose(0, 1)
        out.backward(dy.to(dtype))
        return [out.float(), leaf.grad.float()]

    ref = run(document_mask(cu, T, causal=causal, backend="segments", device="cuda"), torch.float32)
    got = run(document_mask(cu, T, causal=causal, backend=backend, device="cuda"), torch.bfloat16)
    errors = [((g - r).norm() / r.norm()).item() for g, r in zip(got, ref)]
    assert max(errors) <= 2e-2, errors


def test_flex_options_add_to_the_defaults_per_kind_of_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LONGWEAVE_FLEX_OPTIONS`` gives kernel options to one kind of mask or both (none by default: not even
    ``ROWS_GUARANTEED_SAFE``, see ``vision.attention``), and a malformed setting is refused by name."""
    monkeypatch.delenv("LONGWEAVE_FLEX_OPTIONS", raising=False)
    assert flex_kernel_options(True) == flex_kernel_options(False) == {}
    monkeypatch.setenv("LONGWEAVE_FLEX_OPTIONS", '{"causal": {"bwd_BLOCK_M1": 32, "num_warps": 4}}')
    assert flex_kernel_options(True) == {"bwd_BLOCK_M1": 32, "num_warps": 4}
    assert flex_kernel_options(False) == {}
    for bad in ('{"decoder": {}}', '{"causal": 4}', "[1]", "{causal"):
        monkeypatch.setenv("LONGWEAVE_FLEX_OPTIONS", bad)
        with pytest.raises(ValueError, match="LONGWEAVE_FLEX_OPTIONS"):
            flex_kernel_options(True)


def test_each_kind_of_mask_compiles_flex_attention_apart() -> None:
    """FlexAttention compiled on the CPU (Inductor's C++ kernels) agrees with the per-segment path for both kinds of
    mask, and each kind has its own compiled code (with one code object for both, the vision tower's changing
    length would make the code dynamic for the decoder too). One length each: Inductor's CPU template for a dynamic
    length does not compile (torch 2.14)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from vision.attention import _compiled_flex_attention

    gen = torch.Generator().manual_seed(0)
    lengths = (40, 1, 55)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    for causal in (False, True):
        q, k, v = (torch.randn(1, 2, T, 16, generator=gen) for _ in range(3))
        got = document_attention(q, k, v, document_mask(cu, T, causal=causal, backend="flex"))
        ref = document_attention(q, k, v, document_mask(cu, T, causal=causal, backend="segments"))
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    codes = [_compiled_flex_attention(causal)._torchdynamo_orig_callable.__code__ for causal in (False, True)]
    assert [len(_debug_get_cache_entry_list(code)) for code in codes] == [1, 1]
