"""The interpreter's bounds check (``bounds.py``, on for every kernel test without CUDA) fails an access a GPU would
fault on and lets masked-off lanes pass."""
from __future__ import annotations

import pytest
import torch

from interpreted import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="checks the interpreter; a GPU faults by itself")


def _copy_kernel():  # noqa: ANN202
    """Defined at call time, under the interpreter the conftest fixture has switched on."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy(x, y, n_load, n_store, B: tl.constexpr):
        o = tl.arange(0, B)
        tl.store(y + o, tl.load(x + o, mask=o < n_load, other=0.), mask=o < n_store)

    return copy


@pytest.mark.parametrize("n_load, n_store, error", [(10, 10, None), (11, 10, "load"), (10, 11, "store")],
                         ids=["masked", "load-past-the-end", "store-past-the-end"])
def test_an_access_past_a_tensor_fails_and_masked_lanes_pass(n_load: int, n_store: int, error: str | None) -> None:
    x, y = torch.randn(10), torch.zeros(10)
    copy = _copy_kernel()
    if error is None:
        copy[(1,)](x, y, n_load, n_store, B=16)
        torch.testing.assert_close(y, x)
        return
    with pytest.raises(Exception, match=f"{error} out of bounds in program \\(0, 0, 0\\): 1 of 11 live lanes"):
        copy[(1,)](x, y, n_load, n_store, B=16)
