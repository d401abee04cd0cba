"""Kernel tests without CUDA run the Triton kernels under the interpreter (fp32; bf16 only with `gpu_numerics`), every
load and store bounds-checked as a GPU would fault (`bounds.py`).

Triton picks interpreter or compiler when a kernel is defined, so each test module (re)imports its kernel package with
``TRITON_INTERPRET=1``; the fixture here keeps the variable set while the folder's tests run, because the kernels read
it again when they dispatch. ``make test`` runs this folder in its own process with the variable set from the start,
so the rest of the suite keeps the plain PyTorch references.
"""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    """The interpreter without CUDA, its memory accesses bounds-checked (``bounds.py``) as a GPU would fault."""
    with pytest.MonkeyPatch.context() as mp:
        if not torch.cuda.is_available():
            from bounds import patch

            mp.setenv("TRITON_INTERPRET", "1")
            patch(mp)
        yield


@pytest.fixture
def gpu_numerics(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter with a GPU's bf16 and tf32 arithmetic (``gpu_numerics.py``) for one test."""
    from gpu_numerics import patch

    patch(monkeypatch)
