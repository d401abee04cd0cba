"""Image geometry properties: multiples of 28, token bounds, aspect within one merged patch, monotone in size."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vision.geometry import DEFAULT_POLICY, GeometryError, VisionPolicy, image_tokens, merged_grid, target_size

UNIT = DEFAULT_POLICY.unit
POLICIES = st.sampled_from([DEFAULT_POLICY, VisionPolicy(min_tokens=4, max_tokens=256, max_aspect_ratio=50),
                            VisionPolicy(min_tokens=64, max_tokens=4096)])


@st.composite
def image_sizes(draw, policy_strategy=POLICIES):
    policy = draw(policy_strategy)
    short = draw(st.integers(1, 6000))
    ratio = draw(st.floats(1.0, policy.max_aspect_ratio))
    long = max(short, min(int(short * ratio), 60000))
    if long / short > policy.max_aspect_ratio:
        long = short
    h, w = (short, long) if draw(st.booleans()) else (long, short)
    return policy, h, w


@settings(max_examples=400, deadline=None)
@given(image_sizes())
def test_sides_are_multiples_of_the_merged_patch_and_tokens_in_bounds(case) -> None:
    policy, h, w = case
    th, tw = target_size(h, w, policy)
    assert th % policy.unit == 0 and tw % policy.unit == 0 and th > 0 and tw > 0
    tokens = image_tokens(h, w, policy)
    assert tokens == (th // policy.unit) * (tw // policy.unit)
    assert policy.min_tokens <= tokens <= policy.max_tokens


@settings(max_examples=400, deadline=None)
@given(image_sizes())
def test_aspect_error_under_one_merged_patch(case) -> None:
    """Some single scale s maps both sides to within one merged patch of the chosen size."""
    policy, h, w = case
    th, tw = target_size(h, w, policy)
    u = policy.unit
    lo = max((th - u) / h, (tw - u) / w)
    hi = min((th + u) / h, (tw + u) / w)
    assert lo <= hi * (1 + 1e-12), (h, w, th, tw)


@settings(max_examples=300, deadline=None)
@given(image_sizes(), st.integers(2, 8))
def test_monotone_in_area(case, k: int) -> None:
    """Scaling an image up (same aspect) never gives fewer tokens."""
    policy, h, w = case
    assert image_tokens(h, w, policy) <= image_tokens(k * h, k * w, policy)


@settings(max_examples=300, deadline=None)
@given(image_sizes())
def test_resized_image_keeps_its_grid(case) -> None:
    """The pipeline stores resized images; the model recomputes tokens from the stored size and must agree."""
    policy, h, w = case
    th, tw = target_size(h, w, policy)
    assert merged_grid(th, tw, policy) == merged_grid(h, w, policy)


def test_known_sizes() -> None:
    assert target_size(512, 512) == (504, 504)
    assert image_tokens(28 * 10, 28 * 20) == 200
    assert image_tokens(1, 1) == DEFAULT_POLICY.min_tokens
    assert image_tokens(8000, 6000) <= DEFAULT_POLICY.max_tokens


def test_ties_are_exact() -> None:
    """Where a side's scaled size is exactly half-way, floats used to round the two sides (or an image and its
    3x copy) differently."""
    policy = VisionPolicy(min_tokens=4, max_tokens=256, max_aspect_ratio=50)
    assert image_tokens(3528, 72, policy) == image_tokens(10584, 216, policy) == 244
    # Both sides reach their next patch at the same scale (3 x 350 > 1024): the grid just below that scale.
    assert merged_grid(145, 20271) == (2, 349)
    assert merged_grid(28 * 10 + 14, 28 * 10) == (11, 10)   # half up at the native scale


def test_rejects_bad_shapes_and_policies() -> None:
    with pytest.raises(GeometryError, match="aspect ratio"):
        image_tokens(10, 10 * 500)
    with pytest.raises(GeometryError, match="positive"):
        image_tokens(0, 10)
    with pytest.raises(ValueError, match="max_tokens"):
        VisionPolicy(min_tokens=100, max_tokens=200)
    with pytest.raises(ValueError, match="patch_size"):
        VisionPolicy(patch_size=0)


def test_fingerprint_tracks_policy() -> None:
    assert DEFAULT_POLICY.fingerprint() == VisionPolicy().fingerprint()
    assert DEFAULT_POLICY.fingerprint() != VisionPolicy(max_tokens=2048).fingerprint()
