"""Wall-clock time of one forward + backward of the model, the way its GPU test, profiler and the loader bench
measure it: gradients cleared, the device idle at the start and synchronised at the end."""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainer.model.multimodal import LongweaveModel, ModelOutput


def timed_forward_backward(model: LongweaveModel, inputs: Callable[[], Mapping[str, Any]]
                           ) -> tuple[float, ModelOutput]:
    """Seconds of ``model(**inputs()).loss.backward()`` (``inputs`` is called inside the timing, so a host-to-device
    copy it makes is counted) and the output."""
    cuda = next(model.parameters()).is_cuda
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model(**inputs())
    out.loss.backward()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, out
