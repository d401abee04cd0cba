"""Gated multi-head latent attention (NoPE): the decoder's full-attention layers, one in four by default.

Keys and values come up from one shared latent ``c = W_dkv x`` (``k = W_uk c``, ``v = W_uv c``), so at inference the
cache holds ``c`` only. No positional encoding: the KDA layers around it carry order. Attention is causal and stays
inside each document of the packed sequence (the shared mask of ``PackedSequence``). An output gate
``o ⊙ sigmoid(W_go x)`` before the output projection lets a head switch itself off (no attention sink needed).
"""
from __future__ import annotations

import torch
from torch import nn

from trainer.model.config import MLAConfig
from trainer.model.fused import joint_linear, sigmoid_gate
from trainer.model.sequence import PackedSequence
from vision.attention import document_attention

__all__ = ["MLALayer"]


class MLALayer(nn.Module):
    """``forward(x [T, d], seq) -> [T, d]`` over the flattened packed tokens."""

    def __init__(self, d_model: int, config: MLAConfig, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.config = config
        width = config.n_heads * config.head_dim
        self.q_proj = nn.Linear(d_model, width, bias=False)
        self.kv_down = nn.Linear(d_model, config.kv_rank, bias=False)
        self.kv_norm = nn.RMSNorm(config.kv_rank, eps=norm_eps)
        self.k_up = nn.Linear(config.kv_rank, width, bias=False)
        self.v_up = nn.Linear(config.kv_rank, width, bias=False)
        self.gate_proj = nn.Linear(d_model, width, bias=False)
        self.o_proj = nn.Linear(width, d_model, bias=False)

    def forward(self, x: torch.Tensor, seq: PackedSequence) -> torch.Tensor:
        if seq.mask is None:
            raise ValueError("seq.mask: an MLA layer needs the causal document mask (packed_sequence(with_mask=True))")
        T = x.shape[0]
        H, D = self.config.n_heads, self.config.head_dim
        q, c, gate = joint_linear(x, self.q_proj, self.kv_down, self.gate_proj)  # the three projections of x: one GEMM
        k, v = joint_linear(self.kv_norm(c), self.k_up, self.v_up)
        q, k, v = (t.reshape(T, H, D).transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = document_attention(q, k, v, seq.mask, scale=D ** -0.5).squeeze(0).transpose(0, 1).reshape(T, H * D)
        return self.o_proj(sigmoid_gate(o, gate))
