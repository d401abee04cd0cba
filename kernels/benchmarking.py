"""What every forward + backward benchmark here does the same way: CUDA-event medians and JSON-lines output."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence

import torch
import triton


def fwd_bwd_times(call: Callable[[], torch.Tensor | Sequence[torch.Tensor]],
                  leaves: list[torch.Tensor]) -> dict[str, float]:
    """Median ms of ``call()`` and of its backward from fixed random gradients of its output (or outputs)
    (``triton.testing.do_bench``, CUDA events), after one untimed step so compiles and autotuning stay out;
    ``leaves``' gradients are cleared between backward runs."""
    def outputs() -> tuple[torch.Tensor, ...]:
        out = call()
        return (out,) if isinstance(out, torch.Tensor) else tuple(out)

    dys = [torch.randn_like(y) for y in outputs()]

    def step() -> None:
        torch.autograd.backward(outputs(), dys)

    step()
    return dict(fwd_ms=triton.testing.do_bench(call, return_mode="median"),
                fwdbwd_ms=triton.testing.do_bench(step, grad_to_none=leaves, return_mode="median"))


def append_json_lines(path: str | None, rows: Iterable[dict]) -> None:
    """One JSON object a line, appended (nothing when ``path`` is None)."""
    if path:
        with open(path, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
