"""Model configuration: one small dataclass per component, validated on construction, plus the named presets.

A run is a config: ``preset("small")`` or ``ModelConfig.from_dict(yaml.safe_load(...))``; ``to_dict()`` gives the
JSON written to the run directory. Errors name the field (``ModelConfig.moe.top_k: ...``) so a bad YAML is easy to fix.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from vision.config import VisionEncoderConfig, recompute_count, require_positive_ints

__all__ = [
    "KDAConfig", "MLAConfig", "MoEConfig", "AttnResConfig", "ModelConfig", "VisionEncoderConfig",
    "tiny", "small", "PRESETS", "preset",
]

LayerKind = Literal["kda", "mla"]
LAYER_KINDS = ("kda", "mla")


@dataclasses.dataclass(kw_only=True, slots=True)
class KDAConfig:
    """Kimi Delta Attention mixer: ``n_heads`` heads with state ``head_dim × head_dim``; gate bounded below by
    ``gate_lower_bound`` (the kernel's sub-chunk exponent range relies on it). Packed sequences longer than
    ``segment_tokens`` (None: never) run the whole layer in checkpointed segments of that many tokens, so one
    layer's backward holds one segment's projections and kernel intermediates (``kernels.kda.segments``)."""

    n_heads: int = 8
    head_dim: int = 128
    conv_size: int = 4
    gate_lower_bound: float = -5.0
    norm_eps: float = 1e-6
    segment_tokens: int | None = 262144
    # The kernels' chunk (32 or 64 tokens, ``kernels.kda.chunk.CHUNK_SIZES``): the same outputs either way, to rounding;
    # a speed setting, which the FLOP count follows (the intra-chunk work per token scales with it).
    chunk_size: int = 64

    def __post_init__(self) -> None:
        require_positive_ints(self, "n_heads", "head_dim", "conv_size")
        if self.segment_tokens is not None and (self.segment_tokens < 64 or self.segment_tokens % 64):
            raise ValueError(f"KDAConfig.segment_tokens: must be a positive multiple of 64 (the kernel's chunk) "
                             f"or null, got {self.segment_tokens}")
        if self.chunk_size not in (32, 64):
            raise ValueError(f"KDAConfig.chunk_size: must be 32 or 64 (the kernels' chunks), got {self.chunk_size}")
        if not -5.0 <= self.gate_lower_bound < 0:
            raise ValueError(f"KDAConfig.gate_lower_bound: must lie in [-5, 0) (kernel exponent range), "
                             f"got {self.gate_lower_bound}")


@dataclasses.dataclass(kw_only=True, slots=True)
class MLAConfig:
    """Gated multi-head latent attention (NoPE): keys and values come up from a ``kv_rank`` latent."""

    n_heads: int = 8
    head_dim: int = 128
    kv_rank: int = 512

    def __post_init__(self) -> None:
        require_positive_ints(self, "n_heads", "head_dim", "kv_rank")


@dataclasses.dataclass(kw_only=True, slots=True)
class MoEConfig:
    """FFNs: the first ``n_dense_layers`` are dense SwiGLU of width ``d_dense``; the rest route each token to
    ``top_k`` of ``n_experts`` SwiGLU experts of width ``d_expert`` plus ``n_shared`` shared ones."""

    n_experts: int = 64
    top_k: int = 4
    d_expert: int = 256
    n_shared: int = 1
    n_dense_layers: int = 1
    d_dense: int = 2816
    gate_scale: float = 1.0
    bias_ema: float = 0.0
    # "exact" keeps every token's routing residuals [T, E] fp32 until the step (0.5 GiB per layer at 1M tokens);
    # "histogram" keeps ~1000 bins per expert. "auto" is exact on one rank, histogram across ranks.
    balance_method: str = "auto"
    backend: str = "auto"

    def __post_init__(self) -> None:
        require_positive_ints(self, "n_experts", "top_k", "d_expert", "d_dense")
        if self.top_k >= self.n_experts:
            # The balancer reads the (k+1)-th largest score, so at least one expert must stay unchosen.
            raise ValueError(f"MoEConfig.top_k: must be < n_experts={self.n_experts}, got {self.top_k}")
        for name in ("n_shared", "n_dense_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"MoEConfig.{name}: must be a non-negative int, got {value!r}")
        if not self.gate_scale > 0:
            raise ValueError(f"MoEConfig.gate_scale: must be > 0, got {self.gate_scale}")
        if self.balance_method not in ("auto", "exact", "histogram"):
            raise ValueError(f"MoEConfig.balance_method: must be auto, exact or histogram, got {self.balance_method!r}")


@dataclasses.dataclass(kw_only=True, slots=True)
class AttnResConfig:
    """Block attention residuals. Sublayers (each attention and each FFN) are split into ``n_blocks`` equal blocks;
    ``n_blocks == 2 · n_layers`` is full AttnRes. ``enabled=False`` gives standard pre-norm residuals.
    ``two_phase``: mix a block's finished-blocks parts for all its sublayers at once where none is recomputed (the
    same sums, fewer passes over memory; one ``[T, d]`` more per sublayer until the backward). Off: on an H100 at
    8 × 8K it was no faster in the step and 0.93× in its bench (BENCHMARKS.md, 2026-12-07)."""

    enabled: bool = True
    n_blocks: int = 8
    two_phase: bool = False

    def __post_init__(self) -> None:
        require_positive_ints(self, "n_blocks")


@dataclasses.dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The whole multimodal model. ``layer_pattern`` is cycled over the ``n_layers`` decoder layers."""

    vocab_size: int = 32768
    d_model: int = 1024
    n_layers: int = 20
    layer_pattern: tuple[LayerKind, ...] = ("kda", "kda", "kda", "mla")
    kda: KDAConfig = dataclasses.field(default_factory=KDAConfig)
    mla: MLAConfig = dataclasses.field(default_factory=MLAConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    attn_res: AttnResConfig = dataclasses.field(default_factory=AttnResConfig)
    vision: VisionEncoderConfig = dataclasses.field(default_factory=VisionEncoderConfig)
    image_pad_id: int = 4
    norm_eps: float = 1e-6
    init_std: float = 0.02
    ce_chunk_tokens: int = 8192  # rows of logits alive at once in the loss
    # Activation checkpointing of the decoder layers: True (every layer), False (none), or N: the first N layers
    # recompute in the backward and the rest keep their activations (Megatron's "block" recompute method), for a
    # stage whose activations almost fit: each layer left out saves its share of the recompute.
    checkpoint_layers: bool | int = False
    # The MoE layers not recomputed keep their routed rows [T·k, d] from the forward to the backward rather than
    # gathering them again for the experts' weight gradient (the recomputed ones always do: there the rows live only
    # from the recompute to the backward): T·k·d more bytes per layer (512 MiB at 65,536 tokens, top-4, d = 1024)
    # against the gather (81 ms of the 8k step on the H200, 2026-12-06). For a stage with memory to spare.
    keep_routed_rows: bool = False

    def __post_init__(self) -> None:
        require_positive_ints(self, "vocab_size", "d_model", "n_layers", "ce_chunk_tokens")
        self.layer_pattern = tuple(self.layer_pattern)
        if not self.layer_pattern or any(kind not in LAYER_KINDS for kind in self.layer_pattern):
            raise ValueError(f"ModelConfig.layer_pattern: must be a non-empty sequence of {LAYER_KINDS}, "
                             f"got {self.layer_pattern!r}")
        self.recomputed_layers()
        if not 0 <= self.image_pad_id < self.vocab_size:
            raise ValueError(f"ModelConfig.image_pad_id: must lie in [0, vocab_size), got {self.image_pad_id}")
        if self.moe.n_dense_layers > self.n_layers:
            raise ValueError(f"ModelConfig.moe.n_dense_layers: must be <= n_layers={self.n_layers}, "
                             f"got {self.moe.n_dense_layers}")
        if self.attn_res.enabled and (2 * self.n_layers) % self.attn_res.n_blocks:
            raise ValueError(f"ModelConfig.attn_res.n_blocks: must divide the {2 * self.n_layers} sublayers "
                             f"(2 per layer), got {self.attn_res.n_blocks}")
        if not self.init_std > 0:
            raise ValueError(f"ModelConfig.init_std: must be > 0, got {self.init_std}")

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Mixer of each decoder layer: the pattern cycled to ``n_layers``."""
        return tuple(self.layer_pattern[i % len(self.layer_pattern)] for i in range(self.n_layers))

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.moe.n_dense_layers

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready nested dict (tuples become lists)."""
        return dataclasses.asdict(self)

    def recomputed_layers(self) -> int:
        """How many decoder layers, counted from the first, recompute their activations in the backward."""
        return recompute_count("ModelConfig.checkpoint_layers", self.checkpoint_layers, self.n_layers)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error naming them."""
        nested = {"kda": KDAConfig, "mla": MLAConfig, "moe": MoEConfig, "attn_res": AttnResConfig,
                  "vision": VisionEncoderConfig}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown fields {unknown}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in nested and isinstance(value, Mapping):
                sub = nested[key]
                bad = sorted(set(value) - {f.name for f in dataclasses.fields(sub)})
                if bad:
                    raise ValueError(f"ModelConfig.{key}: unknown fields {bad}")
                value = sub(**value)
            kwargs[key] = value
        return cls(**kwargs)


def tiny() -> ModelConfig:
    """A few hundred thousand non-embedding parameters: CPU tests and the demo."""
    return ModelConfig(
        d_model=64,
        n_layers=4,
        kda=KDAConfig(n_heads=2, head_dim=32),
        mla=MLAConfig(n_heads=2, head_dim=32, kv_rank=32),
        moe=MoEConfig(n_experts=8, top_k=2, d_expert=32, n_shared=1, d_dense=128),
        attn_res=AttnResConfig(enabled=True, n_blocks=4),
        vision=VisionEncoderConfig(d_model=32, n_layers=2, n_heads=2),
        ce_chunk_tokens=256,
    )


def small() -> ModelConfig:
    """About 1.9B total / 0.29B active parameters; the decoder alone (no embeddings, no vision) is 9.9× sparser
    (1.80B / 0.18B, see ``trainer.model.flops``). Sized for a 1M-token sequence on one H200 with activation
    checkpointing: 20 layer boundaries of 2 GiB (1M × 1024 bf16) plus 8 AttnRes blocks, ~31 GB of weights with
    fp32 master and Adam states, and one layer's recompute at a time."""
    return ModelConfig(
        d_model=1024,
        n_layers=20,
        kda=KDAConfig(n_heads=8, head_dim=128),
        mla=MLAConfig(n_heads=8, head_dim=128, kv_rank=512),
        moe=MoEConfig(n_experts=128, top_k=4, d_expert=224, n_shared=1, d_dense=2816, balance_method="histogram"),
        attn_res=AttnResConfig(enabled=True, n_blocks=8),
        vision=VisionEncoderConfig(d_model=512, n_layers=12, n_heads=8, checkpoint_layers=True),
        ce_chunk_tokens=8192,
        checkpoint_layers=True,
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {"tiny": tiny, "small": small}


def preset(name: str) -> ModelConfig:
    """A fresh config of the named preset."""
    if name not in PRESETS:
        raise ValueError(f"model preset: must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]()
