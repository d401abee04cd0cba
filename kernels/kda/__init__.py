"""Kimi Delta Attention with bounded decay: Triton chunk kernels beside float32 PyTorch references."""
from kernels.kda.chunk import chunk_kda
from kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda
from kernels.kda.segments import chunk_kda_segmented

__all__ = ["chunk_kda", "chunk_kda_segmented", "naive_chunk_kda", "naive_recurrent_kda"]
