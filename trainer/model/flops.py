"""Parameter and FLOP accounting from a ``ModelConfig`` alone (no model needed), for logs and MFU.

Parameters: exact counts per component (the tests check them against the real modules), total and active (a token
uses ``top_k`` of the routed experts).

Training FLOPs (forward + backward) follow the usual convention: every weight used in a multiply-accumulate costs
6 FLOPs per token it touches (2 forward, 4 backward); elementwise work (norms, gates' sigmoids, RoPE) is not counted.
On top of the weights:

- **KDA chunked cost**, per head and token, forward, chunks of ``C`` (``KDAConfig.chunk_size``): intra-chunk
  ``A_kk = kkᵀ``, ``A_qk = qkᵀ``, ``w = A k``, ``u = A v`` and ``A_qk v_new`` (``2C(3K + 2V)``), the triangular
  solve (``2C²/3``), and the state terms ``v_new = u − wS``, ``qS``, ``S += kᵀv_new`` (``6KV``); backward counted
  as twice the forward.
- **MLA causal cost**: ``QKᵀ`` and ``AV`` over the causal pairs of each document, ``4·H·D·n(n+1)/2`` forward for a
  document of ``n`` tokens, times 3 for training.
- **Active experts**: router plus ``top_k`` routed and the shared experts per token.
- **Vision tower**: its weights per patch (the merger per merged token) plus full attention inside each image.
- **LM head**: only for the tokens that carry a label (the loss computes no other logits).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from trainer.model.config import KDAConfig, MLAConfig, ModelConfig, MoEConfig
from vision.config import VisionEncoderConfig

__all__ = [
    "H200_BF16_PEAK_FLOPS", "ParamCount", "FlopBreakdown", "kda_params", "mla_params",
    "dense_ffn_params", "moe_params", "vision_params", "count_parameters", "training_flops", "mfu",
]

TRAIN_FACTOR = 3  # forward + backward (twice the forward)
H200_BF16_PEAK_FLOPS = 791e12  # measured dense bf16 GEMM ceiling (DESIGN.md, Kernels)


def kda_params(d_model: int, cfg: KDAConfig) -> tuple[int, int]:
    """(all parameters, those in multiply-accumulates) of one KDA layer."""
    H, K = cfg.n_heads, cfg.head_dim
    width = H * K
    matmul = (3 * d_model * width + 3 * width * cfg.conv_size + d_model * H + d_model * K + K * width
              + d_model * width + width * d_model)
    return matmul + H + width + K, matmul  # + A_log, dt_bias, o_norm


def mla_params(d_model: int, cfg: MLAConfig) -> tuple[int, int]:
    """(all parameters, those in multiply-accumulates) of one MLA layer."""
    width, r = cfg.n_heads * cfg.head_dim, cfg.kv_rank
    matmul = d_model * width + d_model * r + 2 * r * width + d_model * width + width * d_model
    return matmul + r, matmul  # + kv_norm


def dense_ffn_params(d_model: int, d_ffn: int) -> int:
    return 3 * d_model * d_ffn


def moe_params(d_model: int, cfg: MoEConfig) -> tuple[int, int]:
    """(total, active per token) parameters of one MoE layer."""
    expert = 3 * d_model * cfg.d_expert
    router = cfg.n_experts * d_model
    return (router + (cfg.n_experts + cfg.n_shared) * expert, router + (cfg.top_k + cfg.n_shared) * expert)


def vision_params(cfg: VisionEncoderConfig, out_dim: int) -> tuple[int, int, int]:
    """(all parameters, per-patch matmul weights, per-merged-token matmul weights) of the vision tower."""
    d, m = cfg.d_model, cfg.d_mlp
    wide = d * cfg.merge * cfg.merge
    block_matmul = 3 * d * d + d * d + 2 * d * m
    block_other = 4 * d + 3 * d + d + m + d  # two LayerNorms, biases of qkv, proj, fc1, fc2
    per_patch = cfg.patch_dim * d + cfg.n_layers * block_matmul
    per_token = wide * wide + wide * out_dim
    total = per_patch + d + cfg.n_layers * block_other + 2 * d + per_token + wide + out_dim
    return total, per_patch, per_token


@dataclasses.dataclass(frozen=True, slots=True)
class ParamCount:
    """``by_component`` keys: embed, vision, kda, mla, dense_ffn, moe, norms, attn_res, lm_head."""

    total: int
    active: int
    by_component: dict[str, int]

    @property
    def active_non_embedding(self) -> int:
        return self.active - self.by_component["embed"] - self.by_component["lm_head"]


def count_parameters(config: ModelConfig) -> ParamCount:
    d, kinds = config.d_model, config.layer_kinds
    n_moe = sum(config.is_moe_layer(i) for i in range(config.n_layers))
    moe_total, moe_active = moe_params(d, config.moe)
    by = {
        "embed": config.vocab_size * d,
        "vision": vision_params(config.vision, d)[0],
        "kda": kinds.count("kda") * kda_params(d, config.kda)[0],
        "mla": kinds.count("mla") * mla_params(d, config.mla)[0],
        "dense_ffn": (config.n_layers - n_moe) * dense_ffn_params(d, config.moe.d_dense),
        "moe": n_moe * moe_total,
        "norms": 2 * config.n_layers * d + d,
        "attn_res": (2 * config.n_layers + 1) * d if config.attn_res.enabled else 0,
        "lm_head": config.vocab_size * d,
    }
    total = sum(by.values())
    return ParamCount(total=total, active=total - n_moe * (moe_total - moe_active), by_component=by)


@dataclasses.dataclass(frozen=True, slots=True)
class FlopBreakdown:
    """Training FLOPs of one step by layer type, and the tokens they were spent on."""

    kda: float
    mla: float
    dense_ffn: float
    moe: float
    lm_head: float
    vision: float
    tokens: int

    @property
    def total(self) -> float:
        return self.kda + self.mla + self.dense_ffn + self.moe + self.lm_head + self.vision

    def per_token(self) -> dict[str, float]:
        """FLOPs per decoder token of each layer type (the MFU log line)."""
        parts = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tokens"}
        return {name: value / max(self.tokens, 1) for name, value in {**parts, "total": self.total}.items()}


def _kda_core_per_token(cfg: KDAConfig) -> float:
    K = V = cfg.head_dim
    C = cfg.chunk_size
    forward = 2 * C * (3 * K + 2 * V) + 2 * C * C / 3 + 6 * K * V
    return TRAIN_FACTOR * cfg.n_heads * forward


def training_flops(config: ModelConfig, doc_lengths: Sequence[int], image_grids: Iterable[tuple[int, int]] = (),
                   n_loss_tokens: int | None = None) -> FlopBreakdown:
    """FLOPs of one forward + backward over documents of ``doc_lengths`` tokens (their sum is the step's tokens;
    padding segments count as documents, since the model computes them), images of merged grids ``image_grids``,
    and ``n_loss_tokens`` labelled tokens (default: every token)."""
    d, kinds = config.d_model, config.layer_kinds
    tokens = int(sum(doc_lengths))
    n_kda, n_mla = kinds.count("kda"), kinds.count("mla")
    n_moe = sum(config.is_moe_layer(i) for i in range(config.n_layers))
    six = 2 * TRAIN_FACTOR
    kda = n_kda * tokens * (six * kda_params(d, config.kda)[1] + _kda_core_per_token(config.kda))
    causal_pairs = sum(n * (n + 1) / 2 for n in doc_lengths)
    mla_core = TRAIN_FACTOR * 4 * config.mla.n_heads * config.mla.head_dim * causal_pairs
    mla = n_mla * (six * mla_params(d, config.mla)[1] * tokens + mla_core)
    dense = (config.n_layers - n_moe) * six * dense_ffn_params(d, config.moe.d_dense) * tokens
    moe = n_moe * six * moe_params(d, config.moe)[1] * tokens
    lm_head = six * config.vocab_size * d * (tokens if n_loss_tokens is None else n_loss_tokens)
    vcfg = config.vision
    _, per_patch, per_merged = vision_params(vcfg, d)
    group = vcfg.merge * vcfg.merge
    vision = 0.0
    for rows, cols in image_grids:
        patches = rows * cols * group
        attention = TRAIN_FACTOR * 4 * vcfg.d_model * patches * patches * vcfg.n_layers
        vision += six * (per_patch * patches + per_merged * rows * cols) + attention
    return FlopBreakdown(kda=kda, mla=mla, dense_ffn=dense, moe=moe, lm_head=lm_head, vision=vision, tokens=tokens)


def mfu(flops: float, seconds: float, n_devices: int = 1, peak_flops: float = H200_BF16_PEAK_FLOPS) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the devices' bf16 peak."""
    if seconds <= 0:
        raise ValueError(f"seconds: must be > 0, got {seconds}")
    return flops / seconds / (n_devices * peak_flops)
