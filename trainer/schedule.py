"""Warmup-stable-decay learning rate, a function of the global optimizer step so it carries across stages."""
from __future__ import annotations

__all__ = ["wsd_factor"]


def wsd_factor(step: int, *, total_steps: int, warmup_steps: int, decay_fraction: float, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based): linear warmup, flat, linear decay at the end."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = int(round(total_steps * decay_fraction))
    decay_start = total_steps - decay_steps
    if decay_steps <= 0 or step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return 1.0 - (1.0 - min_ratio) * progress
