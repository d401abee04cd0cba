"""The autotuning helpers every Triton kernel here is tuned through (``kernels.tuning``)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton

from kernels import tuning


def kernel_stub(H: int) -> None:
    """Stands for a kernel where triton.autotune is faked."""


def test_autotune_keeps_its_results_in_tritons_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict = {}

    def fake_autotune(configs, key, **kwargs):  # noqa: ANN001, ANN202 - triton.autotune's signature
        seen.update(configs=configs, key=key, **kwargs)
        return lambda fn: SimpleNamespace(base_fn=fn, arg_names=["H"], early_config_prune=None)

    monkeypatch.setattr(triton, "autotune", fake_autotune)
    tuner = tuning.autotune([({"BT": 2}, 8), ({"BT": 1}, 4)], key=["H"], restore_value=["u"])(kernel_stub)
    assert seen["key"] == ["H"] and seen["restore_value"] == ["u"]
    assert tuner.early_config_prune is not None  # the committed picks' hook
    assert seen.get("cache_results") is True  # the pinned Triton supports it
    # the whole space on a GPU, its first entry under the interpreter
    expected = [({"BT": 2}, 8), ({"BT": 1}, 4)] if torch.cuda.is_available() else [({"BT": 2}, 8)]
    assert [(c.kwargs, c.num_warps) for c in seen["configs"]] == expected


def test_a_space_entry_may_cap_registers() -> None:
    """A third element caps registers per thread (more blocks per SM); two-element entries leave Triton's default."""
    capped, plain = tuning.config({"BT": 1}, 8, 128), tuning.config({"BT": 2}, 4)
    assert (capped.kwargs, capped.num_warps, capped.maxnreg) == ({"BT": 1}, 8, 128)  # the pinned Triton has maxnreg
    assert (plain.kwargs, plain.num_warps, plain.maxnreg) == ({"BT": 2}, 4, None)
