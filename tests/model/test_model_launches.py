"""The CPU launch counter (``python -m trainer.model.launches``) runs the model with its stand-ins for the GPU
kernels: a stand-in whose signature falls behind the model's breaks it without any other test noticing."""
from __future__ import annotations

import pytest

from trainer.model import launches


def test_counts_a_step_of_small_at_reduced_width(capsys: pytest.CaptureFixture[str]) -> None:
    launches.main(["--seq-len", "2700", "--width", "64", "--top", "5"])
    out = capsys.readouterr().out
    assert out.startswith("launching ATen ops per step: ")
    total = int(out.split("per step: ")[1].split(";")[0].replace(",", ""))
    assert total > 1000 and "[kernels/moe]" in out and "host syncs per step:" in out
