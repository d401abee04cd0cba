"""Regional compilation of small pure-PyTorch pieces (pointwise chains, row reductions): ``torch.compile`` fuses each
into a kernel or two on CUDA, where a step is otherwise bound by launching hundreds of tiny kernels; everywhere else
(CPU tests, the demo) the plain function runs unchanged.

Only functions without custom autograd Functions, Triton kernels or host syncs go through here. ``LONGWEAVE_COMPILE=0``
turns it off (the eager baseline, for A/B timing). It lives in ``vision`` so the vision tower may use it without
importing ``trainer``.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["cuda_compiled", "compile_enabled", "FUSED"]

F = TypeVar("F", bound=Callable[..., Any])

# Each fused function may see a few argument layouts (AttnRes mixes 1 … n_blocks + 1 sources, grad on and off);
# dynamo's default of 8 compilations per function would silently fall back to eager past that.
_RECOMPILE_LIMIT = 64

FUSED: list[Callable[..., Any]] = []  # every function wrapped here (trainer.model.launches counts their calls)


def compile_enabled() -> bool:
    return os.environ.get("LONGWEAVE_COMPILE", "1") != "0"


def _first_tensor(args: tuple) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0]
    return None


def cuda_compiled(fn: F) -> F:
    """``fn`` compiled (on first use) when its first tensor argument is on CUDA, ``fn`` itself otherwise.
    ``wrapper.plain`` is the uncompiled function (tests compare the two)."""
    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        x = _first_tensor(args)
        if x is None or not x.is_cuda or not compile_enabled() or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if compiled is None:
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, _RECOMPILE_LIMIT)
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    wrapper.plain = fn  # type: ignore[attr-defined]
    FUSED.append(fn)
    return wrapper  # type: ignore[return-value]
