"""Autotuning spaces: the whole space on a GPU, only its first entry under the interpreter (nothing to time)."""
from __future__ import annotations

import torch
import triton


def configs(space: list[tuple[dict, int]]) -> list[triton.Config]:
    """triton.Config for each (meta-parameters, num_warps) pair."""
    chosen = space if torch.cuda.is_available() else space[:1]
    return [triton.Config(meta, num_warps=warps) for meta, warps in chosen]


def fit_v(space: list[triton.Config], nargs: dict, **kwargs) -> list[triton.Config]:
    """Drop V blocks wider than V and K blocks wider than K (early_config_prune hook)."""
    def fits(c: triton.Config) -> bool:
        return c.kwargs.get("BV", 0) <= kwargs["V"] and c.kwargs.get("BK", 0) <= kwargs.get("K", float("inf"))
    return [c for c in space if fits(c)] or space[:1]
