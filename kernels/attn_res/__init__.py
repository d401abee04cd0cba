"""Block attention residuals' mixture of sources (softmax over a pseudo-query's logits, weighted sum, optional
RMSNorm): a Triton kernel each way beside its PyTorch reference."""
from kernels.attn_res.mix import GradSink, attn_res_mix, sinked
from kernels.attn_res.naive import naive_attn_res_mix

__all__ = ["GradSink", "attn_res_mix", "naive_attn_res_mix", "sinked"]
