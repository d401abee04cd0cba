"""Per-step expert load: the balance figure that training logs."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LoadStats:
    """Load over one step, as device tensors (no host sync until `as_dict`).
    tokens_per_expert int64 `[E]` (routed slots, so it sums to T·k); max_over_mean fp64 `[]` = max
    load / mean load (1.0 is perfect); cv fp64 `[]` = std / mean of the load; dropped_tokens is 0
    by construction (dropless: every routed slot is computed)."""

    tokens_per_expert: torch.Tensor
    max_over_mean: torch.Tensor
    cv: torch.Tensor
    dropped_tokens: int = 0

    @classmethod
    def from_counts(cls, counts: torch.Tensor) -> LoadStats:
        """Summarise counts `[E]`."""
        load = counts.double()
        mean = load.mean()
        return cls(tokens_per_expert=counts, max_over_mean=load.max() / mean, cv=load.std(correction=0) / mean)

    def as_dict(self) -> dict[str, float]:
        """Scalars for a metrics logger (one host sync)."""
        ratio, cv = torch.stack([self.max_over_mean, self.cv]).tolist()
        return {"max_over_mean": ratio, "cv": cv, "dropped_tokens": float(self.dropped_tokens)}
