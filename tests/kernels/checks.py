"""What the kernel tests share besides the interpreter switch: fresh seeds they print, and the relative error."""
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
