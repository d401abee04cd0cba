"""Configuration of the vision tower (its own file so model modules hold modules only)."""
from __future__ import annotations

import dataclasses

__all__ = ["VisionEncoderConfig", "recompute_count", "require_positive_ints"]


def require_positive_ints(owner: object, *names: str) -> None:
    """Config check shared by the model configs: each named field is an int >= 1 (bools refused), else a
    ``ValueError`` naming ``Class.field``."""
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{type(owner).__name__}.{name}: must be a positive int, got {value!r}")


def recompute_count(field: str, setting: bool | int, n_layers: int) -> int:
    """Layers, counted from the first, that an activation-checkpointing ``setting`` recomputes: True (all), False
    (none) or a count in [0, n_layers]; else a ``ValueError`` naming ``field``."""
    if isinstance(setting, bool):
        return n_layers if setting else 0
    if not isinstance(setting, int) or not 0 <= setting <= n_layers:
        raise ValueError(f"{field}: must be true, false or a layer count in [0, {n_layers}], got {setting!r}")
    return setting


@dataclasses.dataclass(kw_only=True, slots=True)
class VisionEncoderConfig:
    """NaViT-style ViT: ``n_layers`` pre-norm blocks of width ``d_model`` over 14×14 patches with 2D RoPE, then a
    ``merge × merge`` patch merger and an MLP projector to the decoder width (given by the decoder's config)."""

    patch_size: int = 14
    merge: int = 2
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    mlp_ratio: float = 4.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # Recompute blocks in the backward (long packs of images): True (every block), False (none), or N (the first N),
    # as the decoder's ``ModelConfig.checkpoint_layers``: at 8K the tower's activations of the blocks left out fit and
    # their second forward is saved, at 1M every block recomputes.
    checkpoint_layers: bool | int = False

    def __post_init__(self) -> None:
        require_positive_ints(self, "patch_size", "merge", "d_model", "n_layers", "n_heads")
        if self.d_model % self.n_heads:
            raise ValueError(f"VisionEncoderConfig.n_heads: must divide d_model={self.d_model}, got {self.n_heads}")
        if self.head_dim % 4:
            # 2D RoPE rotates one quarter-pair of the head per axis: the head width must split into 4 equal parts.
            raise ValueError(f"VisionEncoderConfig.n_heads: head_dim d_model/n_heads must be a multiple of 4, "
                             f"got {self.head_dim}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"VisionEncoderConfig.mlp_ratio: must be > 0, got {self.mlp_ratio}")
        if not self.rope_theta > 1:
            raise ValueError(f"VisionEncoderConfig.rope_theta: must be > 1, got {self.rope_theta}")
        self.recomputed_layers()

    def recomputed_layers(self) -> int:
        """How many blocks, counted from the first, recompute their activations in the backward."""
        return recompute_count("VisionEncoderConfig.checkpoint_layers", self.checkpoint_layers, self.n_layers)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_mlp(self) -> int:
        return int(self.d_model * self.mlp_ratio)

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size * self.patch_size
