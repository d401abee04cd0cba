"""The parameter/FLOP counter agrees with the real modules and with the standard 6·N·tokens rule."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.moe import MoELayer
from trainer.model import AttnResConfig, LongweaveModel, ModelConfig, preset, tiny
from trainer.model.decoder import DenseFFN
from trainer.model.flops import (TRAIN_FACTOR, count_parameters, dense_ffn_params, mfu, moe_params,
                                 training_flops)
from trainer.model.kda import KDALayer
from trainer.model.mla import MLALayer


def _numel(modules: list[torch.nn.Module]) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def _real_components(model: LongweaveModel) -> dict[str, int]:
    layers = list(model.decoder.layers)
    of = lambda kind: [m for m in model.modules() if isinstance(m, kind)]  # noqa: E731
    return {
        "embed": model.embed.weight.numel(),
        "vision": _numel([model.vision]),
        "kda": _numel(of(KDALayer)),
        "mla": _numel(of(MLALayer)),
        "dense_ffn": _numel(of(DenseFFN)),
        "moe": _numel(of(MoELayer)),
        "norms": _numel([l.mixer_norm for l in layers] + [l.ffn_norm for l in layers] + [model.norm]),
        "attn_res": _numel([model.decoder.residuals]),
        "lm_head": model.lm_head.weight.numel(),
    }


@pytest.mark.parametrize("config", [
    pytest.param(tiny(), id="tiny"),
    pytest.param(dataclasses.replace(tiny(), attn_res=AttnResConfig(enabled=False), layer_pattern=("mla", "kda")),
                 id="tiny-noattnres-mla-first"),
    pytest.param(preset("small"), id="small"),
])
def test_parameter_counts_equal_the_modules(config: ModelConfig) -> None:
    with torch.device("meta"):  # small's 1.9B parameters cost no memory on the meta device
        model = LongweaveModel(config)
    counted = count_parameters(config)
    assert counted.by_component == _real_components(model)
    assert counted.total == sum(p.numel() for p in model.parameters())
    moe = config.moe
    n_moe = config.n_layers - moe.n_dense_layers
    unrouted = n_moe * (moe.n_experts - moe.top_k) * 3 * config.d_model * moe.d_expert
    assert counted.active == counted.total - unrouted


def test_small_is_one_to_two_billion_and_about_ten_times_sparser() -> None:
    counted = count_parameters(preset("small"))
    by = counted.by_component
    decoder_total = counted.total - by["embed"] - by["lm_head"] - by["vision"]
    decoder_active = counted.active - by["embed"] - by["lm_head"] - by["vision"]
    assert 1e9 <= counted.total <= 2e9
    assert 9 <= decoder_total / decoder_active <= 11


def test_dense_layer_flops_are_six_n_tokens() -> None:
    config = tiny()
    docs = [int(n) for n in torch.randint(1, 500, (5,))]
    flops = training_flops(config, docs)
    dense_module = DenseFFN(config.d_model, config.moe.d_dense)
    assert flops.dense_ffn == 6 * _numel([dense_module]) * sum(docs)
    moe_layer = MoELayer(config.d_model, config.moe.d_expert, config.moe.n_experts, config.moe.top_k,
                         n_shared=config.moe.n_shared)
    unrouted = (config.moe.n_experts - config.moe.top_k) * 3 * config.d_model * config.moe.d_expert
    assert flops.moe == 3 * 6 * (_numel([moe_layer]) - unrouted) * sum(docs)  # 3 MoE layers, active weights only
    assert moe_params(config.d_model, config.moe)[0] == _numel([moe_layer])
    assert dense_ffn_params(config.d_model, config.moe.d_dense) == _numel([dense_module])


def test_mla_cost_follows_causal_pairs_per_document_and_kda_is_linear() -> None:
    config = tiny()
    one = training_flops(config, [1000])
    split = training_flops(config, [500, 500])
    mla_core = lambda pairs: TRAIN_FACTOR * 4 * config.mla.n_heads * config.mla.head_dim * pairs  # noqa: E731
    assert one.mla - split.mla == pytest.approx(mla_core(1000 * 1001 / 2 - 2 * 500 * 501 / 2))
    assert one.kda == pytest.approx(split.kda)  # linear in tokens, whatever the document split
    assert training_flops(config, [2000]).kda == pytest.approx(2 * one.kda)
    # The loss computes logits only for labelled tokens.
    assert training_flops(config, [1000], n_loss_tokens=10).lm_head == 6 * config.vocab_size * config.d_model * 10


def test_kda_intra_chunk_cost_follows_the_kernels_chunk() -> None:
    """Chunks of 32 halve the intra-chunk products per token (2C(3K + 2V) and the 2C^2/3 solve) and leave the
    state terms (6KV) and the projections as they are."""
    config = tiny()
    half = dataclasses.replace(config, kda=dataclasses.replace(config.kda, chunk_size=32))
    H, K = config.kda.n_heads, config.kda.head_dim
    n_kda, tokens = config.layer_kinds.count("kda"), 1000
    per_token = lambda C: 2 * C * 5 * K + 2 * C * C / 3  # noqa: E731  (K = V)
    saved = n_kda * tokens * TRAIN_FACTOR * H * (per_token(64) - per_token(32))
    assert training_flops(config, [tokens]).kda - training_flops(half, [tokens]).kda == pytest.approx(saved)
    with pytest.raises(ValueError, match=r"KDAConfig.chunk_size: must be 32 or 64 .* got 16"):
        dataclasses.replace(config.kda, chunk_size=16)


def test_vision_flops_grow_with_patches_and_per_token_sums_to_total() -> None:
    config = tiny()
    none = training_flops(config, [256])
    two = training_flops(config, [256], image_grids=[(4, 4), (2, 8)])
    assert none.vision == 0 and two.vision > 0 and two.total - none.total == pytest.approx(two.vision)
    per_token = two.per_token()
    assert per_token["total"] == pytest.approx(sum(v for k, v in per_token.items() if k != "total"))
    assert mfu(two.total, 1.0, peak_flops=two.total) == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"seconds: must be > 0, got 0"):
        mfu(1.0, 0)
