"""The Triton interpreter with a GPU's memory bounds: every lane a load, store or atomic lets through its mask must
land inside the storage of one of the launch's tensor arguments.

On a GPU such an access is an illegal-address fault (or silent corruption of a neighbour); the interpreter reads and
writes host memory instead, usually without a sign. With the check, a kernel test run without CUDA fails at the
first out-of-bounds lane and names the program (grid index) and the operation. It told apart, on 2026-12-07, a
kernel that faulted on the H100 only at K = 64 (no lane out of bounds: the compiled code's fault) from an indexing
bug.
"""
from __future__ import annotations

import numpy as np
import pytest

try:
    import triton.runtime.interpreter as interpreter
    BUILDER, EXECUTOR = interpreter.InterpreterBuilder, interpreter.GridExecutor
    HOOKS = {name: getattr(BUILDER, name)
             for name in ("create_masked_load", "create_masked_store", "create_atomic_rmw")}
    INIT_ARGS = EXECUTOR._init_args_hst
except (ImportError, AttributeError) as err:   # the private hooks moved: say so rather than check nothing
    BUILDER = None
    MISSING = f"triton.runtime.interpreter lacks the hooks the bounds check patches ({err})"

_RANGES: list[tuple[int, int]] = []   # [start, end) byte ranges of the running launch's tensor arguments


def _record_ranges(self, args_dev, kwargs):  # noqa: ANN001, ANN202
    args, kw = INIT_ARGS(self, args_dev, kwargs)
    _RANGES.clear()
    pending = [*args, *kw.values()]
    while pending:   # tuples of tensors (a launch's list of sources) and descriptors' bases included
        arg = pending.pop()
        if isinstance(arg, tuple):
            pending.extend(arg)
        elif hasattr(arg, "base") and hasattr(arg, "block_shape"):
            pending.append(arg.base)
        elif hasattr(arg, "untyped_storage"):
            storage = arg.untyped_storage()
            _RANGES.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return args, kw


def check(ptrs, mask, what: str) -> None:  # noqa: ANN001
    """Raise naming the program and operation when a live lane of ``ptrs`` is outside every argument's storage."""
    lanes = ptrs.data if mask is None else ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape).astype(bool)]
    if lanes.size == 0:
        return
    size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
    inside = np.zeros(lanes.shape, dtype=bool)
    for start, end in _RANGES:
        inside |= (lanes >= start) & (lanes + size <= end)
    if not inside.all():
        raise IndexError(f"{what} out of bounds in program {tuple(interpreter.interpreter_builder.grid_idx)}: "
                         f"{int((~inside).sum())} of {lanes.size} live lanes outside every tensor argument")


def _load(self, ptrs, mask, *rest):  # noqa: ANN001, ANN202
    check(ptrs, mask, "load")
    return HOOKS["create_masked_load"](self, ptrs, mask, *rest)


def _store(self, ptrs, value, mask, *rest):  # noqa: ANN001, ANN202
    check(ptrs, mask, "store")
    return HOOKS["create_masked_store"](self, ptrs, value, mask, *rest)


def _atomic_rmw(self, op, ptr, val, mask, *rest):  # noqa: ANN001, ANN202
    check(ptr, mask, "atomic")
    return HOOKS["create_atomic_rmw"](self, op, ptr, val, mask, *rest)


def patch(mp: pytest.MonkeyPatch) -> None:
    """Check the interpreter's memory accesses until ``mp`` is undone; fail loudly where the hooks moved."""
    if BUILDER is None:
        pytest.fail(MISSING)
    mp.setattr(EXECUTOR, "_init_args_hst", _record_ranges)
    mp.setattr(BUILDER, "create_masked_load", _load)
    mp.setattr(BUILDER, "create_masked_store", _store)
    mp.setattr(BUILDER, "create_atomic_rmw", _atomic_rmw)
