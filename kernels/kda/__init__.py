"""Kimi Delta Attention with bounded decay: Triton chunk kernels beside float32 PyTorch references."""
from kernels.kda.chunk import chunk_kda
from kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda

__all__ = ["chunk_kda", "naive_chunk_kda", "naive_recurrent_kda"]
