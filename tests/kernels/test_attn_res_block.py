"""Block AttnRes in two phases (``kernels.attn_res.block``) against one mixture per sublayer on the reference: each
sublayer's normed input from its block's part and the open block, forward and every gradient (finished blocks and
their inv_rms, the open block and its inv_rms, the pseudo-queries, the norm weights), with finished blocks sinked or
not, on fresh random inputs."""
from __future__ import annotations

import pytest
import torch

from checks import block_shapes, fresh_seed, rel_err
from interpreted import import_interpreted

import_interpreted("kernels.attn_res")

from kernels.attn_res import (GradSink, attn_res_block_mix, attn_res_merge, block,  # noqa: E402
                              naive_attn_res_mix, sinked)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(T: int, D: int, n: int, S: int, dtype: torch.dtype = torch.float32) -> dict:
    """n finished blocks of different scales, an open block, S queries and S norm weights."""
    fresh_seed()
    finished = [(torch.randn(T, D, device=DEVICE) * (0.5 + i)).to(dtype) for i in range(n)]
    partial = (torch.randn(T, D, device=DEVICE) * 1.7).to(dtype)
    return dict(finished=finished, partial=partial, queries=torch.randn(S, D, device=DEVICE) * 2,
                weights=1 + 0.1 * torch.randn(S, D, device=DEVICE), dy=torch.randn(S, T, D, device=DEVICE).to(dtype))


def _inv_rms(x: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt((x.float() ** 2).mean(-1) + 1e-6)


def run(case: dict, two_phase: bool, with_partial: tuple[bool, ...], sink: bool = False) -> dict[str, torch.Tensor]:
    """Every sublayer's normed input and the gradients of Σ_l y_l·dy_l; sublayer l sees the open block when
    ``with_partial[l]``. Inv_rms are computed from their tensors (so their gradients reach the leaves)."""
    leaves = {f"b{i}": b.detach().clone().requires_grad_() for i, b in enumerate(case["finished"])}
    leaves["p"] = case["partial"].detach().clone().requires_grad_()
    leaves["q"] = case["queries"].detach().clone().requires_grad_()
    leaves["g"] = case["weights"].detach().clone().requires_grad_()
    n = len(case["finished"])
    sinks = [GradSink() for _ in range(n)] if sink else [None] * n
    blocks = [sinked(leaves[f"b{i}"], s) if s else leaves[f"b{i}"] for i, s in enumerate(sinks)]
    rms = [_inv_rms(b) for b in blocks]
    partial, partial_rms = leaves["p"], _inv_rms(leaves["p"])
    mixture = attn_res_block_mix(blocks, rms, leaves["q"], sinks=sinks) if two_phase else None
    outputs = []
    for l, has_p in enumerate(with_partial):
        if two_phase:
            y = attn_res_merge(mixture, l, partial if has_p else None, partial_rms if has_p else None,
                               leaves["q"][l], leaves["g"][l], 1e-6)
        else:
            sources, source_rms = (blocks + [partial], rms + [partial_rms]) if has_p else (blocks, rms)
            y = naive_attn_res_mix(sources, source_rms, leaves["q"][l], leaves["g"][l], 1e-6)
        outputs.append(y)
    loss = sum((y.float() * dy.float()).sum() for y, dy in zip(outputs, case["dy"]))
    loss.backward()
    return {f"y{l}": y.detach() for l, y in enumerate(outputs)} | {f"d{k}": v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("T, D, n, with_partial", [
    pytest.param(5, 32, 1, (False, True), id="one-finished-two-sublayers"),
    pytest.param(70, 48, 3, (False, True, True), id="width-48-three-sublayers"),
    pytest.param(130, 64, 8, (False, True, True, True, True), id="eight-finished-five-sublayers-three-programs"),
    pytest.param(33, 32, 2, (True, True, False, True, True, True, True, True, True), id="nine-sublayers"),
])
@pytest.mark.parametrize("sink", [False, True], ids=["autograd", "sinked"])
def test_matches_one_mixture_per_sublayer(T: int, D: int, n: int, with_partial: tuple[bool, ...], sink: bool) -> None:
    """Float32 on the kernels against float64 on the one-mixture reference: within 1e-4 everywhere."""
    case = make_case(T, D, n, len(with_partial))
    wide = {k: ([t.double() for t in v] if isinstance(v, list) else v.double()) for k, v in case.items()}
    ref = run(wide, False, with_partial)
    got = run(case, True, with_partial, sink)
    errors = {k: rel_err(got[k], ref[k]) for k in ref}
    assert max(errors.values()) <= 1e-4, errors


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs one config per kernel; a GPU tunes all")
@pytest.mark.parametrize("space", ["BLOCK_FWD_SPACE", "BLOCK_BWD_SPACE", "MERGE_FWD_SPACE", "MERGE_BWD_SPACE"])
def test_every_tuning_config_matches_reference(space: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each entry of a space (the GPU's tuning may pick any) over rows that end part-way through a program."""
    from kernels.tuning import config

    kernel = {"BLOCK_FWD_SPACE": block.block_mix_fwd_kernel, "BLOCK_BWD_SPACE": block.block_mix_bwd_kernel,
              "MERGE_FWD_SPACE": block.merge_fwd_kernel, "MERGE_BWD_SPACE": block.merge_bwd_kernel}[space]
    for entry in block_shapes(getattr(block, space)):
        monkeypatch.setattr(kernel, "configs", [config(*entry)])
        case = make_case(67, 32, 3, 3)
        wide = {k: ([t.double() for t in v] if isinstance(v, list) else v.double()) for k, v in case.items()}
        errors = {k: rel_err(a, b) for (k, a), b in zip(run(case, True, (False, True, True), True).items(),
                                                       run(wide, False, (False, True, True)).values())}
        assert max(errors.values()) <= 1e-4, (entry, errors)


def test_queries_of_the_wrong_width_are_refused() -> None:
    case = make_case(5, 32, 2, 2)
    with pytest.raises(ValueError, match="queries must be"):
        attn_res_block_mix(case["finished"], [_inv_rms(b) for b in case["finished"]], case["queries"][:, :16])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_at_the_small_models_shape() -> None:
    """The last block of ``small`` at the 8k stage: 8 finished blocks of 65,536 × 1,024 in bf16, five sublayers,
    the finished blocks sinked, against the float32 one-mixture reference."""
    case = make_case(65536, 1024, 8, 5, dtype=torch.bfloat16)
    shape = (False, True, True, True, True)
    wide = {k: ([t.float() for t in v] if isinstance(v, list) else v.float()) for k, v in case.items()}
    ref = run(wide, False, shape)
    got = run(case, True, shape, sink=True)
    errors = {k: rel_err(got[k], ref[k]) for k in ref}
    assert max(errors.values()) <= 1e-2, errors
