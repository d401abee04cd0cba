"""What the kernel tests share besides the interpreter switch: fresh seeds they print, the relative error, and the
entries of a tuning space the interpreter tells apart."""
from __future__ import annotations

import torch


def fresh_seed() -> int:
    """Seed torch's generator with a new random seed and print it, so a failing run can be replayed."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed={seed}")
    torch.manual_seed(seed)
    return seed


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def block_shapes(space: list[tuple]) -> list[tuple]:
    """One entry of a tuning space per block shape: the interpreter runs a config alike at any number of warps,
    register cap or prefetch depth (``STAGES``, which only ``tl.range`` reads), so the others repeat a run."""
    shapes = {tuple(sorted((k, v) for k, v in entry[0].items() if k != "STAGES")): entry for entry in space}
    return list(shapes.values())
