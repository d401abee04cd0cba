"""Image geometry: the one place that decides an image's resized grid and its token count.

The pipeline calls it to plan sequence layouts and the model calls it to check them, so it must stay importable on
light Beam workers: no torch, no encoder imports here.

One image token covers one merged patch of ``patch * merge`` pixels per side (14 × 2 = 28). An image is resized,
keeping its aspect ratio, so that each side is a multiple of 28 and the token count lies in
``[min_tokens, max_tokens]``. The resize follows one scale factor ``s``: each side becomes
``max(1, floor(s * side / 28 + 1/2))`` merged patches (rounded half up). ``s = 1`` when the native size already
fits; otherwise the grid is the one of the largest feasible scale below 1 (or the smallest above 1).

The grid only changes where one side's ``s * side / 28`` crosses a half-integer (a breakpoint), so the search runs
over those breakpoints in exact integer arithmetic: no float can round one side differently from the other or one
image differently from the same image scaled up. Hence scaling an image up never yields fewer tokens, and each side
stays within half a merged patch of the exactly scaled side. Stored images are already on the grid (sides multiples
of 28 within the bounds) and keep it unchanged, whatever version of this search resized them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

__all__ = ["VisionPolicy", "GeometryError", "target_size", "image_tokens", "merged_grid"]


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


def _side(scale_num: int, scale_den: int, side: int, unit: int) -> int:
    """``max(1, floor(s·side/unit + 1/2))`` for ``s = scale_num / scale_den``, exactly."""
    return max(1, (2 * scale_num * side + scale_den * unit) // (2 * scale_den * unit))


def _grid_at_break(n: int, side: int, other: int, unit: int) -> tuple[int, int]:
    """Grid ``(along side, along other)`` at the scale where ``side`` reaches ``n + 1`` merged patches,
    ``s = (2n + 1)·unit / (2·side)``."""
    return n + 1, _side((2 * n + 1) * unit, 2 * side, other, unit)


def _last_true(lo: int, hi: int, ok) -> int | None:
    """Largest ``n`` in ``[lo, hi]`` with ``ok(n)`` for a predicate true on a prefix; None if ``ok(lo)`` fails."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _axis_candidate(side: int, other: int, policy: VisionPolicy, shrink: bool) -> tuple[int, tuple[int, int]] | None:
    """The feasible breakpoint of ``side`` closest to scale 1 (below it when shrinking, above it when growing), as
    ``(n, grid)``; grids are ``(along side, along other)``."""
    unit = policy.unit

    def tokens(n: int) -> int:
        a, b = _grid_at_break(n, side, other, unit)
        return a * b

    if shrink:  # breakpoints below 1: (2n + 1)·unit < 2·side
        n = _last_true(0, (2 * side - unit - 1) // (2 * unit), lambda n: tokens(n) <= policy.max_tokens)
    else:  # breakpoints above 1: (2n + 1)·unit > 2·side; n + 1 >= min_tokens rows always suffice
        first = max(0, (2 * side - unit) // (2 * unit) + 1)
        last = max(first, policy.min_tokens)
        count = _last_true(first, last, lambda n: tokens(n) < policy.min_tokens)
        n = first if count is None else count + 1
    return None if n is None else (n, _grid_at_break(n, side, other, unit))


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
    native = (_side(1, 1, height, unit), _side(1, 1, width, unit))
    if policy.min_tokens <= native[0] * native[1] <= policy.max_tokens:
        return native
    shrink = native[0] * native[1] > policy.max_tokens
    by_rows = _axis_candidate(height, width, policy, shrink)
    by_cols = _axis_candidate(width, height, policy, shrink)
    if by_cols is not None:
        by_cols = by_cols[0], by_cols[1][::-1]
    if by_rows is None or by_cols is None:
        found = by_rows or by_cols
        grid = (1, 1) if found is None else found[1]  # no breakpoint fits below 1: the grid of the smallest scales
    else:
        # Breakpoint scales (2n + 1)·unit / (2·side) compared by cross-multiplication: the later one when
        # shrinking (the last feasible interval), the earlier one when growing (the first feasible one).
        rows_later = (2 * by_rows[0] + 1) * width > (2 * by_cols[0] + 1) * height
        grid = by_rows[1] if rows_later == shrink else by_cols[1]
    assert grid[0] * grid[1] <= policy.max_tokens, "the policy's 4x gap between min and max tokens guarantees a fit"
    return grid


def target_size(height: int, width: int, policy: VisionPolicy = DEFAULT_POLICY) -> tuple[int, int]:
    """Resized ``(height, width)`` in pixels: multiples of ``policy.unit``, aspect kept, tokens within bounds."""
    rows, cols = merged_grid(height, width, policy)
    return rows * policy.unit, cols * policy.unit


def image_tokens(height: int, width: int, policy: VisionPolicy = DEFAULT_POLICY) -> int:
    """Number of ``<|image_pad|>`` tokens an image of ``height × width`` source pixels occupies."""
    rows, cols = merged_grid(height, width, policy)
    return rows * cols
