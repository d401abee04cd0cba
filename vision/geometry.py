"""Image geometry: the one place that decides an image's resized grid and its token count.

The pipeline calls it to plan sequence layouts and the model calls it to check them, so it must stay importable on
light Beam workers: no torch, no encoder imports here.

One image token covers one merged patch of ``patch * merge`` pixels per side (14 × 2 = 28). An image is resized,
keeping its aspect ratio, so that each side is a multiple of 28 and the token count lies in
``[min_tokens, max_tokens]``. The resize follows one scale factor ``s``: each side becomes
``max(1, round(s * side / 28))`` merged patches. ``s = 1`` when the native size already fits; otherwise ``s`` is the
largest scale below 1 (or the smallest above 1) whose grid fits the bounds. Because the grid is a non-decreasing
function of ``s`` along one path, scaling an image up never yields fewer tokens, and each side stays within one merged
patch of the exactly scaled side.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math

__all__ = ["VisionPolicy", "GeometryError", "target_size", "image_tokens", "merged_grid"]

_SEARCH_STEPS = 64  # bisection steps on the scale; 2^-64 relative resolution is far below one pixel


class GeometryError(ValueError):
    """An image whose shape no policy-conforming grid can represent (zero side, extreme aspect ratio)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VisionPolicy:
    """How images become tokens. Its fingerprint travels with every manifest, so changing it is visible downstream."""

    patch_size: int = 14
    merge: int = 2
    min_tokens: int = 16
    max_tokens: int = 1024
    max_aspect_ratio: float = 200.0
    # Decoded-pixel ceiling before any resize: larger claims are decompression bombs and are rejected unread.
    max_source_pixels: int = 50_000_000

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge", "min_tokens", "max_tokens", "max_source_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"VisionPolicy.{name}: must be a positive int, got {value!r}")
        if self.max_tokens < 4 * self.min_tokens:
            # One scale step can move both sides by one merged patch; a 4x gap guarantees a grid exists between.
            raise ValueError(
                f"VisionPolicy.max_tokens: must be at least 4 × min_tokens ({4 * self.min_tokens}), got {self.max_tokens}"
            )
        if not 1.0 <= self.max_aspect_ratio <= self.max_tokens:
            raise ValueError(
                f"VisionPolicy.max_aspect_ratio: must lie in [1, max_tokens={self.max_tokens}], got {self.max_aspect_ratio}"
            )

    @property
    def unit(self) -> int:
        """Pixels per side of one merged patch (one image token)."""
        return self.patch_size * self.merge

    def to_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of the policy."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


DEFAULT_POLICY = VisionPolicy()


def _grid_at(scale: float, height: int, width: int, unit: int) -> tuple[int, int]:
    return max(1, round(scale * height / unit)), max(1, round(scale * width / unit))


def _tokens_at(scale: float, height: int, width: int, unit: int) -> int:
    rows, cols = _grid_at(scale, height, width, unit)
    return rows * cols


def merged_grid(height: int, width: int, policy: VisionPolicy = DEFAULT_POLICY) -> tuple[int, int]:
    """Grid of merged patches ``(rows, cols)`` for an image of ``height × width`` source pixels."""
    if height < 1 or width < 1:
        raise GeometryError(f"image size must be positive, got {height}×{width}")
    unit = policy.unit
    if height % unit == 0 and width % unit == 0:
        on_grid = (height // unit, width // unit)
        if policy.min_tokens <= on_grid[0] * on_grid[1] <= policy.max_tokens:
            return on_grid  # already resized by this policy (rounding may have nudged its aspect past the limit)
    aspect = max(height, width) / min(height, width)
    if aspect > policy.max_aspect_ratio:
        raise GeometryError(
            f"image {height}×{width} has aspect ratio {aspect:.1f} > policy max_aspect_ratio {policy.max_aspect_ratio}"
        )
    tokens = _tokens_at(1.0, height, width, unit)
    if policy.min_tokens <= tokens <= policy.max_tokens:
        return _grid_at(1.0, height, width, unit)
    if tokens > policy.max_tokens:
        # Largest scale in (0, 1) whose grid still fits: bisection keeps `lo` feasible throughout.
        lo, hi = 0.0, 1.0
        for _ in range(_SEARCH_STEPS):
            mid = (lo + hi) / 2
            if _tokens_at(mid, height, width, unit) <= policy.max_tokens:
                lo = mid
            else:
                hi = mid
        return _grid_at(lo, height, width, unit)
    # Smallest scale above 1 that reaches min_tokens: `hi` stays feasible throughout.
    lo, hi = 1.0, 2.0
    while _tokens_at(hi, height, width, unit) < policy.min_tokens:
        lo, hi = hi, hi * 2
    for _ in range(_SEARCH_STEPS):
        mid = (lo + hi) / 2
        if _tokens_at(mid, height, width, unit) >= policy.min_tokens:
            hi = mid
        else:
            lo = mid
    rows, cols = _grid_at(hi, height, width, unit)
    assert rows * cols <= policy.max_tokens, "the policy's 4x gap between min and max tokens guarantees a fit"
    return rows, cols


def target_size(height: int, width: int, policy: VisionPolicy = DEFAULT_POLICY) -> tuple[int, int]:
    """Resized ``(height, width)`` in pixels: multiples of ``policy.unit``, aspect kept, tokens within bounds."""
    rows, cols = merged_grid(height, width, policy)
    return rows * policy.unit, cols * policy.unit


def image_tokens(height: int, width: int, policy: VisionPolicy = DEFAULT_POLICY) -> int:
    """Number of ``<|image_pad|>`` tokens an image of ``height × width`` source pixels occupies."""
    rows, cols = merged_grid(height, width, policy)
    return rows * cols
