"""Kimi Delta Attention layer: a gated delta-rule linear-attention mixer whose state resets at document boundaries.

Per head, state ``S ∈ R^{dk×dv}``: ``S_t = Diag(exp(g_t)) S_{t-1} + β_t k_t (v_t − S_tᵀ k_t)ᵀ``, ``o_t = S_tᵀ q_t/√dk``
(the recurrence itself is ``kernels.kda.chunk_kda``). This module makes its inputs: short causal depthwise
convolutions (width 4) with SiLU on q, k, v; L2-normalised q, k; ``β = sigmoid(W_β x)``; the bounded per-channel decay
``g = g_min·sigmoid(exp(A_h)·(W_g↑ W_g↓ x + dt_bias))``, computed inside the kernel so the bound holds by construction;
and its output, ``W_o(sigmoid(W_g x) ⊙ RMSNorm_head(o))``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.kda import chunk_kda
from trainer.model.config import KDAConfig
from trainer.model.sequence import PackedSequence

__all__ = ["ShortConv", "KDALayer"]

# Initial per-channel decay rates |g| = -g_min·sigmoid(dt_bias) drawn log-uniformly from this range: memories from a
# few to a thousand tokens long. Starting at sigmoid(0) would give |g| = 2.5, a state that forgets within one token.
_DECAY_INIT = (1e-3, 0.5)


class ShortConv(nn.Module):
    """Causal depthwise convolution + SiLU that never reaches into the previous document.

    ``weight[:, j]`` multiplies ``x_{t-j}``. One depthwise ``conv1d`` runs over the whole packed sequence (autograd
    keeps only its input); then the outputs of the few tokens whose window starts before their document — the first
    ``width − 1`` of each — are replaced by their in-document sums, so they see zeros exactly as if the document were
    alone (replaced, not corrected by subtraction, which would leave rounding residue of the previous document).
    """

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.width = width
        self.weight = nn.Parameter(torch.empty(channels, width))
        nn.init.uniform_(self.weight, -1 / math.sqrt(width), 1 / math.sqrt(width))  # nn.Conv1d's default bound

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x ``[T, C]``, positions int64 ``[T]`` (offset inside the document) -> ``[T, C]``."""
        weight = self.weight.to(x.dtype)
        taps = weight.flip(1).unsqueeze(1)  # conv1d correlates: the last tap meets x_t
        out = F.conv1d(F.pad(x.t().unsqueeze(0), (self.width - 1, 0)), taps, groups=x.shape[1])[0].t()
        early = (positions < self.width - 1).nonzero().squeeze(1)
        inside = x[early] * weight[:, 0]
        for j in range(1, self.width):
            tap = torch.where((positions[early] >= j)[:, None], x[(early - j).clamp(min=0)], 0)
            inside = inside + tap * weight[:, j]
        return F.silu(out.index_put((early,), inside))


class KDALayer(nn.Module):
    """``forward(x [T, d], seq) -> [T, d]`` over the flattened packed tokens."""

    def __init__(self, d_model: int, config: KDAConfig) -> None:
        super().__init__()
        self.config = config
        H, K = config.n_heads, config.head_dim
        width = H * K
        self.q_proj = nn.Linear(d_model, width, bias=False)
        self.k_proj = nn.Linear(d_model, width, bias=False)
        self.v_proj = nn.Linear(d_model, width, bias=False)
        self.q_conv = ShortConv(width, config.conv_size)
        self.k_conv = ShortConv(width, config.conv_size)
        self.v_conv = ShortConv(width, config.conv_size)
        self.b_proj = nn.Linear(d_model, H, bias=False)
        self.g_down = nn.Linear(d_model, K, bias=False)  # low-rank decay input, rank = head dim
        self.g_up = nn.Linear(K, width, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))  # exp(0) = 1: the decay starts at the dt_bias prior
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.o_norm = nn.RMSNorm(K, eps=config.norm_eps)
        self.gate_proj = nn.Linear(d_model, width, bias=False)  # full-rank output gate
        self.o_proj = nn.Linear(width, d_model, bias=False)
        self.reset_decay()

    @torch.no_grad()
    def reset_decay(self) -> None:
        """dt_bias = logit(|g| / -g_min) for |g| log-uniform in ``_DECAY_INIT``."""
        lo, hi = (math.log(r / -self.config.gate_lower_bound) for r in _DECAY_INIT)
        p = torch.empty_like(self.dt_bias).uniform_(lo, hi).exp()
        self.dt_bias.copy_(torch.log(p) - torch.log1p(-p))

    def forward(self, x: torch.Tensor, seq: PackedSequence) -> torch.Tensor:
        T = x.shape[0]
        H, K = self.config.n_heads, self.config.head_dim
        q = self.q_conv(self.q_proj(x), seq.positions).view(1, T, H, K)
        k = self.k_conv(self.k_proj(x), seq.positions).view(1, T, H, K)
        v = self.v_conv(self.v_proj(x), seq.positions).view(1, T, H, K)
        beta = torch.sigmoid(self.b_proj(x).float()).view(1, T, H)
        z = self.g_up(self.g_down(x)).view(1, T, H, K)
        o, _ = chunk_kda(q, k, v, z, beta, scale=K ** -0.5, cu_seqlens=seq.cu_seqlens, A_log=self.A_log,
                         dt_bias=self.dt_bias, g_min=self.config.gate_lower_bound, use_qk_l2norm=True)
        o = self.o_norm(o.view(T, H, K)) * torch.sigmoid(self.gate_proj(x)).view(T, H, K)
        return self.o_proj(o.reshape(T, H * K))
