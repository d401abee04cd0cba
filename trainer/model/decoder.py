"""The hybrid decoder stack: KDA and gated-MLA mixers (3 : 1 by default), a dense first FFN, MoE FFNs after it,
joined by standard or block attention residuals."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels.moe import MoELayer, swiglu
from trainer.model.attn_res import BlockAttnRes, ResidualState, StandardResiduals
from trainer.model.config import ModelConfig
from trainer.model.kda import KDALayer
from trainer.model.mla import MLALayer
from trainer.model.sequence import PackedSequence

__all__ = ["DenseFFN", "DecoderLayer", "Decoder"]


class DenseFFN(nn.Module):
    """SwiGLU FFN, ``w2(silu(x W_gate) ⊙ x W_up)``, with the fused gate|up projection the MoE experts use."""

    def __init__(self, d_model: int, d_ffn: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(d_model, 2 * d_ffn, bias=False)
        self.w2 = nn.Linear(d_ffn, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, d]`` -> ``[T, d]``."""
        return self.w2(swiglu(self.w13(x)))


class DecoderLayer(nn.Module):
    """Two sublayers, ``2·index`` (mixer) and ``2·index + 1`` (FFN), each ``v = f(RMSNorm(h))``."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        d, moe = config.d_model, config.moe
        self.kind = config.layer_kinds[index]
        self.mixer_norm = nn.RMSNorm(d, eps=config.norm_eps)
        self.mixer: nn.Module = (KDALayer(d, config.kda) if self.kind == "kda"
                                 else MLALayer(d, config.mla, config.norm_eps))
        self.ffn_norm = nn.RMSNorm(d, eps=config.norm_eps)
        self.ffn: nn.Module = (
            MoELayer(d, moe.d_expert, moe.n_experts, moe.top_k, n_shared=moe.n_shared, gate_scale=moe.gate_scale,
                     bias_ema=moe.bias_ema, balance_method=moe.balance_method, backend=moe.backend)
            if config.is_moe_layer(index) else DenseFFN(d, moe.d_dense)
        )

    def forward(self, state: ResidualState, residuals: nn.Module, seq: PackedSequence,
                keep_routed_rows: bool = False) -> ResidualState:
        """``keep_routed_rows``: the MoE FFN keeps its routed rows for the backward (``MoELayer.forward``)."""
        mixer_at, ffn_at = 2 * self.index, 2 * self.index + 1
        h = residuals.normed_input(state, mixer_at, self.mixer_norm)
        state = residuals.add(state, mixer_at, self.mixer(h, seq))
        h = residuals.normed_input(state, ffn_at, self.ffn_norm)
        out = self.ffn(h, keep_routed_rows) if isinstance(self.ffn, MoELayer) else self.ffn(h)
        return residuals.add(state, ffn_at, out)


class Decoder(nn.Module):
    """``forward(x [T, d] embeddings, seq) -> [T, d]`` final hidden states (before the final norm)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.n_layers))
        n_sublayers = 2 * config.n_layers
        self.residuals: nn.Module = (
            BlockAttnRes(config.d_model, n_sublayers, n_sublayers // config.attn_res.n_blocks, config.norm_eps,
                         two_phase=config.attn_res.two_phase)
            if config.attn_res.enabled else StandardResiduals()
        )

    @property
    def needs_mask(self) -> bool:
        return any(layer.kind == "mla" for layer in self.layers)

    def forward(self, x: torch.Tensor, seq: PackedSequence) -> torch.Tensor:
        recomputed = self.config.recomputed_layers() if torch.is_grad_enabled() else 0
        state = self.residuals.begin(x, recomputed_sublayers=2 * recomputed)
        for i, layer in enumerate(self.layers):
            if i < recomputed:
                state = checkpoint(layer, state, self.residuals, seq, True, use_reentrant=False)
            else:
                state = layer(state, self.residuals, seq, self.config.keep_routed_rows)
        return self.residuals.output(state)
