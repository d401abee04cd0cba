"""What every forward + backward benchmark here does the same way: CUDA-event medians and JSON-lines output."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import torch
import triton


def fwd_bwd_times(call: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> dict[str, float]:
    """Median ms of ``call()`` and of ``call().backward(dy)`` for a fixed random ``dy`` (``triton.testing.do_bench``,
    CUDA events), after one untimed step so compiles and autotuning stay out; ``leaves``' gradients are cleared
    between backward runs."""
    dy = torch.randn_like(call())

    def step() -> None:
        call().backward(dy)

    step()
    return dict(fwd_ms=triton.testing.do_bench(call, return_mode="median"),
                fwdbwd_ms=triton.testing.do_bench(step, grad_to_none=leaves, return_mode="median"))


def append_json_lines(path: str | None, rows: Iterable[dict]) -> None:
    """One JSON object a line, appended (nothing when ``path`` is None)."""
    if path:
        with open(path, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
