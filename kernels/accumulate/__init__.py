"""A low-precision gradient added into its float32 running sum: one Triton kernel beside the PyTorch reference."""
from kernels.accumulate.add import add_into
from kernels.accumulate.naive import naive_add_into

__all__ = ["add_into", "naive_add_into"]
