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
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels.grad_sink import ColumnSink
from kernels.kda import chunk_kda
from kernels.kda.segments import Segment, plan_segments, scan_segments
from kernels.short_conv import short_conv_silu
from trainer.model.config import KDAConfig
from trainer.model.fused import gated_rms_norm, joint_linear
from trainer.model.sequence import PackedSequence

__all__ = ["ShortConv", "KDALayer"]

# Initial per-channel decay rates |g| = -g_min·sigmoid(dt_bias) drawn log-uniformly from this range: memories from a
# few to a thousand tokens long. Starting at sigmoid(0) would give |g| = 2.5, a state that forgets within one token.
_DECAY_INIT = (1e-3, 0.5)


def past_halo(x: torch.Tensor, halo: int) -> torch.Tensor:
    """x's rows after the first ``halo``; x itself when there are none: even a full slice records a backward that
    writes the gradient into fresh zeros of x's size (a fill and a copy per tensor: six per KDA layer)."""
    return x[halo:] if halo else x


class ShortConv(nn.Module):
    """Causal depthwise convolution + SiLU that never reaches into the previous document
    (``kernels.short_conv``); ``weight[:, j]`` multiplies ``x_{t-j}``."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.width = width
        self.weight = nn.Parameter(torch.empty(channels, width))
        nn.init.uniform_(self.weight, -1 / math.sqrt(width), 1 / math.sqrt(width))  # nn.Conv1d's default bound

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x ``[T, C]``, positions int64 ``[T]`` (offset inside the document) -> ``[T, C]``."""
        return short_conv_silu(x, self.weight, positions)[0]


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
        size = self.config.segment_tokens
        if size is None or T <= size:
            return self._mix(x, None, seq.positions, seq.host_cu_seqlens, None)[0]
        # The whole layer (projections, convolutions, kernel, output) in checkpointed segments: a recompute holds one
        # segment's projections and gradients, not the sequence's (at 1M tokens these outweigh the kernel's own).
        # Each segment also reads the conv_size - 1 tokens before it, which its positions zero where a document
        # starts. Pieces by split (and the halo cut from the previous piece), so no backward allocates a gradient
        # of the whole sequence per segment.
        halo = self.config.conv_size - 1
        cu = seq.host_cu_seqlens.tolist()
        segments = plan_segments(cu, size)
        pieces = x.split([seg.end - seg.start for seg in segments])

        def run(i: int, seg: Segment, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            before = pieces[i - 1][-halo:] if i else None
            lo = seg.start - (0 if before is None else before.shape[0])
            return checkpoint(self._mix, pieces[i], before, seq.positions[lo:seg.end],
                              torch.tensor(seg.cu, dtype=torch.int32), h0, use_reentrant=False)

        H, K = self.config.n_heads, self.config.head_dim
        outputs, _ = scan_segments(segments, len(cu) - 1, None, x, (H, K, K), run)
        return torch.cat(outputs)

    def _mix(self, x: torch.Tensor, before: torch.Tensor | None, positions: torch.Tensor, cu_seqlens: torch.Tensor,
             h0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer over tokens x of the documents in cu_seqlens (local to x) from initial states h0 (None: zero, and
        no final states out); ``before``: the tokens just before x, which only feed the convolutions (positions
        cover both)."""
        halo = 0 if before is None else before.shape[0]
        if before is not None:
            x = torch.cat([before, x])
        H, K = self.config.n_heads, self.config.head_dim
        # The six projections of x as one GEMM; q, k, v (side by side in it) through their three short convolutions
        # in one kernel, which writes them as three tensors of their own (q and k L2-normalised over each head
        # there, not by a kernel of their own each way): the KDA kernel keeps v for its backward without keeping q
        # and k alive. The convolutions' backward writes q, k and v's gradient straight into the projection's
        # output gradient (a ColumnSink): autograd would concatenate the four slices' gradients, a copy of all
        # 4,232 columns.
        sink = ColumnSink()
        qkv, b, z_low, gate = joint_linear(x, (self.q_proj, self.k_proj, self.v_proj), self.b_proj, self.g_down,
                                           self.gate_proj, sink=sink)
        convs = (self.q_conv, self.k_conv, self.v_conv)
        T = x.shape[0] - halo
        q, k, v = (past_halo(t, halo).view(1, T, H, K) for t in short_conv_silu(
            qkv, torch.cat([conv.weight for conv in convs]), positions, groups=3, grad_into=(sink, 0), norm_groups=2,
            head_dim=K))
        beta = torch.sigmoid(past_halo(b, halo).float()).view(1, T, H)
        z = self.g_up(past_halo(z_low, halo)).view(1, T, H, K)
        o, ht = chunk_kda(q, k, v, z, beta, scale=K ** -0.5, cu_seqlens=cu_seqlens, initial_state=h0,
                          output_final_state=h0 is not None, A_log=self.A_log, dt_bias=self.dt_bias,
                          g_min=self.config.gate_lower_bound, chunk_size=self.config.chunk_size)
        o = gated_rms_norm(o.view(T, H, K), self.o_norm.weight, self.o_norm.eps, past_halo(gate, halo).view(T, H, K))
        return self.o_proj(o.reshape(T, H * K)), ht
