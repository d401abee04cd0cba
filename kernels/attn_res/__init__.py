"""Block attention residuals' mixture of sources (softmax over a pseudo-query's logits, weighted sum, optional
RMSNorm): a Triton kernel each way beside its PyTorch reference."""
from kernels.attn_res.mix import attn_res_mix
from kernels.attn_res.naive import naive_attn_res_mix

__all__ = ["attn_res_mix", "naive_attn_res_mix"]
