"""The trainer process's host-thread policy (``trainer.engine.one_host_thread``)."""
from __future__ import annotations

import pytest
import torch

from trainer.engine import one_host_thread


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_one_host_thread_on_cuda_unless_omp_num_threads_is_set(threads, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    one_host_thread(torch.device("cpu"))  # the CPU path trains on the host: its threads stay
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    one_host_thread(torch.device("cuda"))  # the user's setting wins
    assert torch.get_num_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    one_host_thread(torch.device("cuda"))
    assert torch.get_num_threads() == 1
