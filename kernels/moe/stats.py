"""Per-step expert load: the balance figure that training logs."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LoadStats:
    """Load over one step. tokens_per_expert int64 `[E]` (routed slots, so it sums to T·k);
    max_over_mean = max load / mean load (1.0 is perfect); cv = std / mean of the load;
    dropped_tokens is 0 by construction (dropless: every routed slot is computed)."""

    tokens_per_expert: torch.Tensor
    max_over_mean: float
    cv: float
    dropped_tokens: int = 0

    @classmethod
    def from_counts(cls, counts: torch.Tensor) -> LoadStats:
        """Summarise counts `[E]` (one host sync)."""
        load = counts.double()
        mean = load.mean()
        ratio, cv = torch.stack([load.max() / mean, load.std(correction=0) / mean]).tolist()
        return cls(tokens_per_expert=counts.detach().cpu(), max_over_mean=ratio, cv=cv)

    def as_dict(self) -> dict[str, float]:
        """Scalars for a metrics logger."""
        return {"max_over_mean": self.max_over_mean, "cv": self.cv, "dropped_tokens": float(self.dropped_tokens)}
