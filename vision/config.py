"""Configuration of the vision tower (its own file so model modules hold modules only)."""
from __future__ import annotations

import dataclasses

__all__ = ["VisionEncoderConfig", "require_positive_ints"]


def require_positive_ints(owner: object, *names: str) -> None:
    """Config check shared by the model configs: each named field is an int >= 1 (bools refused), else a
    ``ValueError`` naming ``Class.field``."""
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{type(owner).__name__}.{name}: must be a positive int, got {value!r}")


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
    checkpoint_layers: bool = False  # recompute each block in backward (long packs of images)

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

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_mlp(self) -> int:
        return int(self.d_model * self.mlp_ratio)

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size * self.patch_size
