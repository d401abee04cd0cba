"""Decoder layers: KDA and MLA follow their formulas and keep documents apart; attention residuals do their
bookkeeping."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.model.attn_res import BlockAttnRes, StandardResiduals
from trainer.model.config import KDAConfig, MLAConfig
from trainer.model.kda import KDALayer, ShortConv
from trainer.model.mla import MLALayer
from trainer.model.sequence import packed_sequence

D_MODEL = 48


def _seq(lengths: list[int], with_mask: bool = True):  # noqa: ANN202 - PackedSequence
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    return packed_sequence(cu, sum(lengths), with_mask=with_mask)


def _kda_reference(layer: KDALayer, x: torch.Tensor) -> torch.Tensor:
    """DESIGN.md's KDA for ONE document, token by token in float32, straight from the layer's weights."""
    T = x.shape[0]
    H, K = layer.config.n_heads, layer.config.head_dim

    def conv(proj: torch.nn.Linear, short: torch.nn.Module) -> torch.Tensor:
        y = proj(x).t()[None]  # [1, C, T]
        taps = short.weight.flip(1)[:, None]  # conv1d correlates: weight[:, j] multiplies x_{t-j}
        return F.silu(F.conv1d(F.pad(y, (short.width - 1, 0)), taps, groups=y.shape[1])[0].t())

    q = F.normalize(conv(layer.q_proj, layer.q_conv).view(T, H, K), dim=-1)
    k = F.normalize(conv(layer.k_proj, layer.k_conv).view(T, H, K), dim=-1)
    v = conv(layer.v_proj, layer.v_conv).view(T, H, K)
    beta = torch.sigmoid(layer.b_proj(x))
    z = layer.g_up(layer.g_down(x)).view(T, H, K) + layer.dt_bias.view(H, K)
    g = layer.config.gate_lower_bound * torch.sigmoid(layer.A_log.exp()[:, None] * z)
    S = torch.zeros(H, K, K)
    outs = []
    for t in range(T):
        S = S * g[t].exp()[:, :, None]
        S = S + beta[t][:, None, None] * k[t][:, :, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, q[t]) * K ** -0.5)
    o = layer.o_norm(torch.stack(outs)) * torch.sigmoid(layer.gate_proj(x)).view(T, H, K)
    return layer.o_proj(o.reshape(T, H * K))


def test_kda_layer_is_the_design_recurrence_with_state_reset_per_document() -> None:
    """Packed [doc1, doc2, doc3]: each document's output equals the token-by-token recurrence on it alone."""
    layer = KDALayer(D_MODEL, KDAConfig(n_heads=2, head_dim=32))
    with torch.no_grad():
        layer.A_log.normal_(std=0.5)  # away from the init, so the gate's A_h enters
    lengths = [37, 70, 5]
    x = torch.randn(sum(lengths), D_MODEL)
    with torch.no_grad():
        packed = layer(x, _seq(lengths, with_mask=False))
        start = 0
        for n in lengths:
            torch.testing.assert_close(packed[start:start + n], _kda_reference(layer, x[start:start + n]),
                                       rtol=1e-4, atol=1e-5)
            start += n


@pytest.mark.parametrize("outer_checkpoint", [False, True], ids=["plain", "in-checkpointed-layer"])
def test_kda_layer_in_segments_matches_one_pass(outer_checkpoint: bool) -> None:
    """segment_tokens cuts a long packed sequence into checkpointed 64-token segments of the whole layer (documents
    and the short convolutions cross their boundaries): the same output, input and parameter gradients as one pass, also nested in the decoder's per-layer
    activation checkpoint."""
    torch.manual_seed(0)
    one = KDALayer(D_MODEL, KDAConfig(n_heads=2, head_dim=32, segment_tokens=None))
    cut = KDALayer(D_MODEL, KDAConfig(n_heads=2, head_dim=32, segment_tokens=64))
    cut.load_state_dict(one.state_dict())
    lengths = [100, 30, 70]
    outs, x_grads = [], []
    seq = _seq(lengths, with_mask=False)
    x0 = torch.randn(sum(lengths), D_MODEL)
    for layer in (one, cut):
        x = x0.clone().requires_grad_()
        out = checkpoint(layer, x, seq, use_reentrant=False) if outer_checkpoint else layer(x, seq)
        out.square().sum().backward()
        outs.append(out.detach())
        x_grads.append(x.grad)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_grads[1], x_grads[0], rtol=1e-4, atol=1e-6)
    for (name, p1), p2 in zip(one.named_parameters(), cut.parameters()):
        # Weight gradients are now sums over segments: float32 summation order, about 2e-7 relative here.
        assert (p2.grad - p1.grad).norm() <= 1e-5 * p1.grad.norm(), name


def test_kda_segment_size_is_a_multiple_of_the_chunk() -> None:
    with pytest.raises(ValueError, match="segment_tokens: must be a positive multiple of 64"):
        KDAConfig(segment_tokens=100)


def test_short_conv_isolation_is_exact_in_bf16() -> None:
    """The tokens at a document start are recomputed, not corrected: no rounding residue of the previous document."""
    conv = ShortConv(16, 4).to(torch.bfloat16)
    x = torch.randn(20, 16, dtype=torch.bfloat16)
    other = x.clone()
    other[:7] = 100 * torch.randn(7, 16, dtype=torch.bfloat16)
    positions = _seq([7, 13], with_mask=False).positions
    with torch.no_grad():
        assert torch.equal(conv(x, positions)[7:], conv(other, positions)[7:])


def test_kda_decay_starts_bounded_and_slow() -> None:
    layer = KDALayer(D_MODEL, KDAConfig(n_heads=4, head_dim=32))
    rate = -layer.config.gate_lower_bound * torch.sigmoid(layer.dt_bias.detach())
    assert float(rate.min()) >= 1e-3 * 0.999 and float(rate.max()) <= 0.5 * 1.001
    assert torch.equal(layer.A_log, torch.zeros(4))


@pytest.mark.parametrize("make", [
    pytest.param(lambda: KDALayer(D_MODEL, KDAConfig(n_heads=2, head_dim=32)), id="kda"),
    pytest.param(lambda: MLALayer(D_MODEL, MLAConfig(n_heads=3, head_dim=16, kv_rank=24)), id="mla"),
])
def test_document_two_does_not_depend_on_document_one(make) -> None:  # noqa: ANN001
    layer = make()
    lengths = [50, 45]
    x = torch.randn(sum(lengths), D_MODEL)
    other = x.clone()
    other[:50] = torch.randn(50, D_MODEL)
    seq = _seq(lengths)
    with torch.no_grad():
        out, out_other = layer(x, seq), layer(other, seq)
        alone = layer(x[50:], _seq([45]))
    torch.testing.assert_close(out[50:], out_other[50:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[50:], alone, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out[:50], out_other[:50])


def test_mla_is_causal_latent_attention_with_output_gate() -> None:
    layer = MLALayer(D_MODEL, MLAConfig(n_heads=2, head_dim=16, kv_rank=8))
    x = torch.randn(30, D_MODEL)
    with torch.no_grad():
        out = layer(x, _seq([30]))
        c = layer.kv_norm(layer.kv_down(x))
        q, k, v = (t.view(30, 2, 16).transpose(0, 1) for t in (layer.q_proj(x), layer.k_up(c), layer.v_up(c)))
        scores = (q @ k.transpose(1, 2)) / 4.0 + torch.full((30, 30), float("-inf")).triu(1)
        o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(30, 32)
        expected = layer.o_proj(o * torch.sigmoid(layer.gate_proj(x)))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_mla_without_mask_is_an_error() -> None:
    layer = MLALayer(D_MODEL, MLAConfig(n_heads=2, head_dim=16, kv_rank=8))
    with pytest.raises(ValueError, match=r"seq.mask: an MLA layer needs the causal document mask"):
        layer(torch.randn(4, D_MODEL), _seq([4], with_mask=False))


def _run(residuals: torch.nn.Module, sublayers: list[torch.nn.Module], embedding: torch.Tensor) -> torch.Tensor:
    state = residuals.begin(embedding)
    for index, f in enumerate(sublayers):
        state = residuals.add(state, index, f(residuals.sublayer_input(state, index)))
    return residuals.output(state)


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _sublayers(n: int, d: int) -> list[torch.nn.Module]:
    return [torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh()) for _ in range(n)]


@pytest.mark.parametrize("residuals", [BlockAttnRes(16, 6, block_size=2), StandardResiduals()],
                         ids=["attn-res", "standard"])
def test_normed_input_is_the_norm_of_the_sublayer_input(residuals: torch.nn.Module) -> None:
    """What a decoder layer consumes, ``normed_input(state, l, norm)`` (mixture and norm fused on CUDA), equals
    ``norm(sublayer_input(state, l))`` at every sublayer, gradients included."""
    torch.manual_seed(0)
    if isinstance(residuals, BlockAttnRes):
        with torch.no_grad():
            residuals.queries.normal_()
    norm = torch.nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    embedding = torch.randn(9, 16, requires_grad=True)
    state = residuals.begin(embedding)
    for index, f in enumerate(_sublayers(6, 16)):
        fused, plain = residuals.normed_input(state, index, norm), norm(residuals.sublayer_input(state, index))
        torch.testing.assert_close(fused, plain)
        grads = [torch.autograd.grad(h.square().sum(), [embedding, norm.weight], retain_graph=True)
                 for h in (fused, plain)]
        for got, want in zip(*grads):  # in two phases the softmax's sums run in another order: 3e-6 apart
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        state = residuals.add(state, index, f(plain))


def test_zero_pseudo_queries_average_the_sources_uniformly() -> None:
    d, n = 16, 6
    embedding = torch.randn(10, d)
    res = BlockAttnRes(d, n, block_size=2)
    seen: list[torch.Tensor] = []
    sublayers = _sublayers(n, d)

    def record(f: torch.nn.Module):  # noqa: ANN202
        return lambda h: (seen.append(h), f(h))[1]

    with torch.no_grad():
        out = _run(res, [record(f) for f in sublayers], embedding)
        v = [embedding]
        for f, h in zip(sublayers, seen):
            v.append(f(h))
        blocks = [v[0], v[1] + v[2], v[3] + v[4], v[5] + v[6]]
    expected_inputs = [blocks[0], (blocks[0] + v[1]) / 2, (blocks[0] + blocks[1]) / 2,
                       (blocks[0] + blocks[1] + v[3]) / 3, sum(blocks[:3]) / 3, (sum(blocks[:3]) + v[5]) / 4]
    for h, expected in zip(seen, expected_inputs):
        torch.testing.assert_close(h, expected)
    torch.testing.assert_close(out, sum(blocks) / 4)


def test_one_sublayer_per_block_is_full_attn_res() -> None:
    d, n = 16, 5
    embedding = torch.randn(12, d)
    res = BlockAttnRes(d, n, block_size=1)
    with torch.no_grad():
        res.queries.normal_()
        sublayers = _sublayers(n, d)
        out = _run(res, sublayers, embedding)
        values = [embedding]
        for index in range(n + 1):
            logits = torch.stack([_rms_norm(v) @ res.queries[index] for v in values], dim=-1)
            h = sum(a[:, None] * v for a, v in zip(logits.softmax(-1).unbind(-1), values))
            if index < n:
                values.append(sublayers[index](h))
    torch.testing.assert_close(out, h, rtol=1e-5, atol=1e-6)


def test_off_is_standard_residuals() -> None:
    d, n = 16, 4
    embedding = torch.randn(8, d)
    sublayers = _sublayers(n, d)
    with torch.no_grad():
        out = _run(StandardResiduals(), sublayers, embedding)
        x = embedding
        for f in sublayers:
            x = x + f(x)
    torch.testing.assert_close(out, x)


def test_block_size_must_divide_sublayers() -> None:
    with pytest.raises(ValueError, match=r"block_size: must divide n_sublayers=6, got 4"):
        BlockAttnRes(8, 6, block_size=4)
