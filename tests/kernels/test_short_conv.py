"""Short convolution + SiLU kernels against the float32 shift-and-add reference, forward and gradients, on fresh
random inputs: document starts, a strided input, grouped outputs, the halo rows of a segment."""
from __future__ import annotations

import sys

import pytest
import torch

from checks import block_shapes, fresh_seed, rel_err
from interpreted import import_interpreted

import_interpreted("kernels.short_conv")

from kernels.short_conv import naive_short_conv_silu, short_conv_silu  # noqa: E402
from kernels.short_conv.conv import row_alignment  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def positions_of(lengths: list[int], first: int = 0) -> torch.Tensor:
    """Each token's offset in its document; ``first``: the first document began that many tokens before row 0 (a
    segment's halo rows)."""
    pos = torch.cat([torch.arange(n) for n in lengths])
    pos[:lengths[0]] += first
    return pos.to(DEVICE)


def make_case(lengths: list[int], C: int, width: int, dtype: torch.dtype = torch.float32, extra: int = 0,
              first: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x ``[T, C]`` as the leading columns of a ``[T, C + extra]`` buffer (rows strided like the joint projection's
    slices), weight ``[C, width]`` and positions; fresh random values each run."""
    fresh_seed()
    T = sum(lengths)
    buffer = torch.randn(T, C + extra, device=DEVICE).to(dtype)
    weight = (torch.randn(C, width, device=DEVICE) / width ** 0.5).to(dtype)
    return buffer[:, :C], weight, positions_of(lengths, first)


def forward_backward(fn, x: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor, groups: int,  # noqa: ANN001
                     dy: torch.Tensor | None, norm: tuple[int, int] = (0, 1)
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output's groups stacked ``[groups, T, C / groups]`` (each group's gradient still reaches fn's backward on
    its own: stack's backward hands each its slice of dy), and the gradients of x and the weight. ``norm``: the
    leading groups L2-normalised and the head dim."""
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    outputs = fn(x, weight, pos, groups, norm_groups=norm[0], head_dim=norm[1])
    assert len(outputs) == groups and all(y.is_contiguous() for y in outputs)
    y = torch.stack(outputs)
    y.backward(dy if dy is not None else torch.ones_like(y))
    return y, x.grad, weight.grad


@pytest.mark.parametrize("lengths, C, width, groups, extra, first", [
    pytest.param([1], 32, 4, 1, 0, 0, id="one-token"),
    pytest.param([5], 32, 4, 1, 0, 0, id="shorter-than-a-block"),
    pytest.param([64], 96, 4, 3, 0, 0, id="one-block-three-groups"),
    pytest.param([30, 1, 2, 70, 97], 64, 4, 2, 40, 0, id="documents-of-1-and-2-tokens-strided"),
    pytest.param([3, 130], 32, 3, 1, 7, 500, id="width-3-halo-rows-odd-stride"),
    pytest.param([200], 160, 4, 1, 0, 0, id="channels-not-a-block-multiple"),
    pytest.param([700, 1, 399], 32, 4, 1, 16, 0, id="several-backward-programs"),
])
def test_matches_reference(lengths: list[int], C: int, width: int, groups: int, extra: int, first: int) -> None:
    x, weight, pos = make_case(lengths, C, width, extra=extra, first=first)
    dy = torch.randn(groups, sum(lengths), C // groups, device=DEVICE)
    y_ref, dx_ref, dw_ref = forward_backward(naive_short_conv_silu, x, weight, pos, groups, dy)
    y, dx, dw = forward_backward(short_conv_silu, x, weight, pos, groups, dy)
    assert y.shape == (groups, sum(lengths), C // groups)
    errors = {"y": rel_err(y, y_ref), "dx": rel_err(dx, dx_ref), "dw": rel_err(dw, dw_ref)}
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.parametrize("columns, dtype, alignment", [
    (4232, torch.bfloat16, 8), (5256, torch.bfloat16, 8), (4100, torch.bfloat16, 4), (39, torch.bfloat16, 1),
    (104, torch.float32, 4), (39, torch.float32, 1)])
def test_row_alignment_is_what_divides_the_stride(columns: int, dtype: torch.dtype, alignment: int) -> None:
    """The kernels may load x's rows in 16-byte vectors only when the row stride is a multiple of that many
    elements; an odd stride (the case above) gets scalar loads."""
    assert row_alignment(torch.empty(2, columns, dtype=dtype)[:, :32]) == alignment


@pytest.mark.parametrize("lengths, C, groups, norm, extra", [
    pytest.param([30, 1, 2, 70, 97], 96, 3, (2, 16), 40, id="two-heads-a-group-strided"),
    pytest.param([200, 57], 384, 3, (2, 128), 8, id="head-wider-than-the-smallest-tiles"),
    pytest.param([64], 64, 1, (1, 64), 0, id="one-group-normalised"),
])
def test_head_l2norm_matches_reference(lengths: list[int], C: int, groups: int, norm: tuple[int, int],
                                       extra: int) -> None:
    """q and k L2-normalised over each head inside the kernels (the KDA layer's), v not: outputs and gradients
    against the reference (SiLU, then ``kernels.kda.l2norm``'s formula). A 128-channel head is wider than the
    smallest channel tiles, which the tuning widens to whole heads."""
    x, weight, pos = make_case(lengths, C, 4, extra=extra)
    dy = torch.randn(groups, sum(lengths), C // groups, device=DEVICE)
    y_ref, dx_ref, dw_ref = forward_backward(naive_short_conv_silu, x, weight, pos, groups, dy, norm)
    y, dx, dw = forward_backward(short_conv_silu, x, weight, pos, groups, dy, norm)
    heads = y[:norm[0]].reshape(norm[0], sum(lengths), -1, norm[1]).norm(dim=-1)
    torch.testing.assert_close(heads, torch.ones_like(heads), rtol=0, atol=1e-4)  # unit heads (none is all zero)
    errors = {"y": rel_err(y, y_ref), "dx": rel_err(dx, dx_ref), "dw": rel_err(dw, dw_ref)}
    assert max(errors.values()) <= 1e-5, errors


def test_norm_arguments_are_checked() -> None:
    x, weight, pos = make_case([10], 48, 4)
    with pytest.raises(ValueError, match="head_dim"):
        short_conv_silu(x, weight, pos, 3, norm_groups=2, head_dim=32)
    with pytest.raises(ValueError, match="norm_groups"):
        short_conv_silu(x, weight, pos, 3, norm_groups=4, head_dim=16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine times the kernels instead")
def test_kernels_load_rows_of_a_16_byte_stride_in_vectors() -> None:
    """Compiled for sm_90 (its own process: the compiler, not the interpreter) as a launch on the joint projection's
    slice specialises them (pointers and the channel count divisible by 16, the row stride 4,232 not): x's tiles
    load as 16-byte vectors once the stride's alignment is a constexpr (2-byte loads while it was not known to
    Triton, before 2026-12-06), one or more for each of the 4 taps; and the dx kernel stores its rows in vectors into
    a gradient of that stride (a ``ColumnSink``'s). Each kernel's loop over rows unpipelined (one stage): pipelined,
    its loads are 16-byte ``cp.async`` copies instead (``test_pipelined_loops.py``)."""
    import os
    import subprocess

    code = """
from kernels.ptxas_report import compile_for_hopper, jit_function, launch_divisible
from kernels.short_conv import conv
from kernels.tuning import config
plain = dict(NORM=False, HD=1)
one_tile = dict(W=4, BT=16, BC=128, ROWS=16, STAGES=1)
for fn, constants, align, op in [(conv.short_conv_fwd_kernel, one_tile | plain, "X_ALIGN", "ld"),
                                 (conv.short_conv_bwd_da_kernel,
                                  dict(W=4, WP=4, ROWS=512, BT=16, BC=64, STAGES=1) | plain, "X_ALIGN", "ld"),
                                 (conv.short_conv_bwd_dx_kernel, one_tile, "DX_ALIGN", "st")]:
    print(*(compile_for_hopper(fn, constants | {align: a}, config({}, 4),
                               divisible=launch_divisible(jit_function(fn), constants | {align: a})).asm["ptx"]
            .count(f"{op}.global.v4") for a in (1, 8)))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=True).stdout
    counts = [tuple(map(int, line.split())) for line in out.splitlines()]
    assert len(counts) == 3 and all(aligned >= unknown + 4 for unknown, aligned in counts[:2]), out
    assert counts[2][1] > counts[2][0], out  # dx's rows stored in vectors into a joint projection's gradient


def graph_nodes(roots: tuple[torch.Tensor, ...]) -> set[str]:
    """Names of every autograd node behind ``roots``."""
    seen, names, stack = set(), set(), [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(parent for parent, _ in node.next_functions)
    return names


@pytest.mark.parametrize("lengths, extra", [([100, 1, 155], 40), ([64, 33], 37)])
def test_gradient_written_into_a_joint_projections_sink(lengths: list[int], extra: int) -> None:
    """The KDA layer's layout: one joint projection whose first 3·C columns feed the grouped convolution and the
    rest other consumers (one of them unused). With a ``ColumnSink`` the convolution's backward writes dx into the
    projection's output gradient (row stride 3·C + extra: 8-element aligned, then an odd one), so autograd
    concatenates nothing; every gradient matches the plain path's."""
    from kernels.grad_sink import ColumnSink, sinked_joint_linear

    fresh_seed()
    T, C, d = sum(lengths), 32, 48
    sizes = (3 * C, extra - 16, 16)
    x0 = torch.randn(T, d, device=DEVICE)
    w0 = torch.randn(sum(sizes), d, device=DEVICE) / d ** 0.5
    conv_w0 = torch.randn(3 * C, 4, device=DEVICE) / 2
    pos = positions_of(lengths)
    dys = [torch.randn(T, C, device=DEVICE) for _ in range(3)]
    d_rest = torch.randn(T, sizes[1], device=DEVICE)

    def run(sink: ColumnSink | None) -> tuple[list[torch.Tensor], set[str]]:
        x, w, conv_w = (t.detach().clone().requires_grad_() for t in (x0, w0, conv_w0))
        if sink is None:
            qkv, rest, _ = (x @ w.t()).split(sizes, dim=1)
        else:
            qkv, rest, _ = sinked_joint_linear(x, w, sizes, sink)
        ys = short_conv_silu(qkv, conv_w, pos, groups=3, grad_into=None if sink is None else (sink, 0))
        loss = sum((y * dy).sum() for y, dy in zip(ys, dys)) + (torch.tanh(rest) * d_rest).sum()
        names = graph_nodes((loss,))
        loss.backward()
        return [x.grad, w.grad, conv_w.grad], names

    want, plain_nodes = run(None)
    got, sink_nodes = run(ColumnSink())
    assert "SplitWithSizesBackward0" in plain_nodes and "SplitWithSizesBackward0" not in sink_nodes
    errors = [rel_err(a, b) for a, b in zip(got, want)]
    assert max(errors) <= 1e-5, errors
    assert not got[1][sum(sizes[:2]):].any()  # the unused slice's weight rows: a zero gradient, not garbage


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs one config per kernel; a GPU tunes all")
@pytest.mark.parametrize("norm", [(0, 1), (2, 32)], ids=["plain", "head-norm"])
@pytest.mark.parametrize("space", ["FWD_SPACE", "DA_SPACE"])
def test_every_tuning_config_matches_reference(space: str, norm: tuple[int, int],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU autotuner may pick any entry of a space, so each must be right: FWD_SPACE serves the forward and the
    dx kernel, DA_SPACE the da kernel. Documents, groups, a strided x and more rows than one da program takes."""
    from kernels.short_conv import conv
    from kernels.tuning import config

    kernels = {"FWD_SPACE": (conv.short_conv_fwd_kernel, conv.short_conv_bwd_dx_kernel),
               "DA_SPACE": (conv.short_conv_bwd_da_kernel,)}[space]
    lengths = [300, 1, 250]
    for entry in block_shapes(getattr(conv, space)):
        for kernel in kernels:
            monkeypatch.setattr(kernel, "configs", [config(*entry)])
        x, weight, pos = make_case(lengths, 64, 4, extra=8)
        dy = torch.randn(2, sum(lengths), 32, device=DEVICE)
        y_ref, dx_ref, dw_ref = forward_backward(naive_short_conv_silu, x, weight, pos, 2, dy, norm)
        y, dx, dw = forward_backward(short_conv_silu, x, weight, pos, 2, dy, norm)
        errors = {"y": rel_err(y, y_ref), "dx": rel_err(dx, dx_ref), "dw": rel_err(dw, dw_ref)}
        assert max(errors.values()) <= 1e-5, (entry, errors)


def test_a_document_never_sees_the_one_before() -> None:
    """Rewriting document 1 leaves document 2's outputs, and the gradient reaching document 1 from document 2's
    outputs, exactly zero-coupled: the taps of document 2's first rows read zeros, not document 1."""
    lengths = [40, 50]
    x, weight, pos = make_case(lengths, 32, 4)
    other = x.clone()
    other[:40] = torch.randn(40, 32, device=DEVICE)
    assert torch.equal(short_conv_silu(x, weight, pos)[0][40:], short_conv_silu(other, weight, pos)[0][40:])
    dy = torch.zeros(1, 90, 32, device=DEVICE)
    dy[:, 40:] = torch.randn(1, 50, 32, device=DEVICE)
    _, dx, _ = forward_backward(short_conv_silu, x, weight, pos, 1, dy)
    assert torch.equal(dx[:40], torch.zeros_like(dx[:40])) and dx[40:].abs().sum() > 0


def test_bf16_with_gpu_numerics(gpu_numerics: None) -> None:
    """bf16 in and out, float32 inside: within bf16's rounding of the float32 reference on the same bf16 inputs."""
    x, weight, pos = make_case([100, 28, 200], 128, 4, dtype=torch.bfloat16, extra=256)
    dy = torch.randn(2, 328, 64, device=DEVICE).bfloat16()
    y_ref, dx_ref, dw_ref = forward_backward(naive_short_conv_silu, x.float(), weight.float(), pos, 2, dy.float())
    y, dx, dw = forward_backward(short_conv_silu, x, weight, pos, 2, dy)
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16
    errors = {"y": rel_err(y, y_ref), "dx": rel_err(dx, dx_ref), "dw": rel_err(dw, dw_ref)}
    assert max(errors.values()) <= 5e-3, errors


@pytest.mark.parametrize("args, match", [
    pytest.param(dict(x=torch.randn(2, 8, 4)), r"x must be \[T, C\], got shape \(2, 8, 4\)", id="x-rank"),
    pytest.param(dict(weight=torch.randn(4, 4)), r"weight must be \[C, width\] = \[8, 1..8\], got shape \(4, 4\)",
                 id="weight-channels"),
    pytest.param(dict(weight=torch.randn(8, 9)), r"weight must be \[C, width\].* got shape \(8, 9\)", id="too-wide"),
    pytest.param(dict(positions=torch.zeros(5)), r"positions must be integer \[T\] = \[6\], got torch.float32 \(5,\)",
                 id="positions"),
    pytest.param(dict(groups=3), r"groups must divide the 8 channels, got 3", id="groups"),
])
def test_bad_arguments_are_named(args: dict, match: str) -> None:
    call = dict(x=torch.randn(6, 8), weight=torch.randn(8, 4), positions=torch.arange(6), groups=1) | args
    with pytest.raises(ValueError, match=match):
        short_conv_silu(**call)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("norm", [(0, 1), (2, 128)], ids=["plain", "q-k-head-norm"])
def test_gpu_bf16_at_the_small_models_shape(norm: tuple[int, int]) -> None:
    """The KDA layer of ``small``: q, k, v (3 × 1024 channels) from the joint projection's [T, 4232] buffer (rows
    16-byte aligned but not 32: the kernels are told, and load them in vectors), 32 documents in 65,536 tokens, bf16
    against the float32 reference; q and k L2-normalised over heads of 128 as the layer runs it."""
    lengths = [2048] * 31 + [65536 - 31 * 2048]
    x, weight, pos = make_case(lengths, 3072, 4, dtype=torch.bfloat16, extra=4232 - 3072)
    dy = torch.randn(3, 65536, 1024, device=DEVICE).bfloat16()
    y_ref, dx_ref, dw_ref = forward_backward(naive_short_conv_silu, x.float(), weight.float(), pos, 3, dy.float(),
                                             norm)
    y, dx, dw = forward_backward(short_conv_silu, x, weight, pos, 3, dy, norm)
    errors = {"y": rel_err(y, y_ref), "dx": rel_err(dx, dx_ref), "dw": rel_err(dw, dw_ref)}
    assert errors["y"] <= 5e-3 and max(errors.values()) <= 1e-2, errors


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the model tests run these kernels themselves")
@pytest.mark.parametrize("segment_tokens", [None, 64], ids=["one-pass", "segments-with-halo"])
def test_kda_layer_on_the_kernels_matches_the_references(segment_tokens: int | None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The KDA layer as a GPU runs it (the Triton short convolution and KDA kernels, here under the interpreter)
    against the same layer on the PyTorch references: q, k and v as the convolution's grouped output, and in 64-token
    segments whose convolutions read the halo rows before them. Output, input and parameter gradients."""
    import torch.nn.functional as F

    import trainer.model.kda as kda_layer
    from trainer.model.config import KDAConfig
    from trainer.model.sequence import packed_sequence

    lengths = [100, 30, 70]
    seq = packed_sequence(F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32), sum(lengths),
                          with_mask=False)
    x0, _, _ = make_case(lengths, 48, 4)
    layer = kda_layer.KDALayer(48, KDAConfig(n_heads=2, head_dim=32, segment_tokens=segment_tokens))
    runs = []
    for kernels in (True, False):
        if not kernels:  # the dispatchers' switch: the references on the CPU
            for fn in (kda_layer.short_conv_silu, kda_layer.chunk_kda):
                monkeypatch.setattr(sys.modules[fn.__module__], "INTERPRET", False)
        layer.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        out = layer(x, seq)
        out.square().sum().backward()
        runs.append([out.detach(), x.grad] + [p.grad for p in layer.parameters()])
    names = ["out", "dx"] + [f"d{n}" for n, _ in layer.named_parameters()]
    errors = {name: rel_err(got, want) for name, got, want in zip(names, *runs, strict=True)}
    assert max(errors.values()) <= 1e-4, errors


def test_kda_layer_keeps_no_convolution_output_of_q_and_k() -> None:
    """After the forward, no saved tensor's storage holds the convolution's q, k and v together (q and k before
    their L2 norm are needed by nothing; had they one buffer with v, the KDA kernel's saved v would keep them)."""
    import torch.nn.functional as F

    from trainer.model.config import KDAConfig
    from trainer.model.kda import KDALayer
    from trainer.model.sequence import packed_sequence

    lengths = [100, 30, 70]
    T, H, K = sum(lengths), 2, 32
    seq = packed_sequence(F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32), T, with_mask=False,
                          device=DEVICE)
    layer = KDALayer(48, KDAConfig(n_heads=H, head_dim=K)).to(DEVICE)
    x = torch.randn(T, 48, device=DEVICE, requires_grad=True)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (sizes.append(t.untyped_storage().nbytes()), t)[1],
                                                  lambda t: t):
        out = layer(x, seq)
    assert 3 * T * H * K * x.element_size() not in sizes, sizes
    assert T * H * K * x.element_size() in sizes  # v itself is still kept
    out.sum().backward()
    assert x.grad is not None and layer.v_conv.weight.grad is not None
