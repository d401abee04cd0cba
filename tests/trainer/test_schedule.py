"""The WSD schedule: linear warmup, flat, linear decay to min_ratio over the last fraction of all steps."""
from __future__ import annotations

import pytest

from trainer.schedule import wsd_factor


def test_warmup_stable_decay_shape() -> None:
    f = [wsd_factor(s, total_steps=100, warmup_steps=10, decay_fraction=0.2, min_ratio=0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(f[:10], f[1:10]))
    assert f[10:80] == [1.0] * 70
    assert all(a > b for a, b in zip(f[80:], f[81:]))
    assert f[99] == pytest.approx(0.1)


def test_no_decay_and_no_warmup() -> None:
    assert [wsd_factor(s, total_steps=5, warmup_steps=0, decay_fraction=0.0, min_ratio=0.0) for s in range(5)] == [1.0] * 5
