"""Causal depthwise short convolution with SiLU that never reaches into the previous document: a Triton kernel each
way beside its float32 PyTorch reference."""
from kernels.short_conv.conv import short_conv_silu
from kernels.short_conv.naive import naive_short_conv_silu

__all__ = ["naive_short_conv_silu", "short_conv_silu"]
