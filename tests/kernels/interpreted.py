"""Triton picks interpreter or compiler when a kernel is defined, so without CUDA each kernel test module (re)imports
its package with ``TRITON_INTERPRET=1``; the folder's conftest fixture keeps the variable set while the tests run."""
from __future__ import annotations

import importlib
import sys

import pytest
import torch

INTERPRET = not torch.cuda.is_available()


def import_interpreted(package: str) -> None:
    """(Re)import ``package`` and its modules under the interpreter when there is no CUDA; nothing on a GPU."""
    if not INTERPRET:
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]
        importlib.import_module(package)
