"""Block attention residuals' mixture of sources (softmax over a pseudo-query's logits, weighted sum, optional
RMSNorm): a Triton kernel each way beside its PyTorch reference, one sublayer at a time (``mix``) or a block's
sublayers at once and then one merge each (``block``)."""
from kernels.attn_res.block import BlockMixture, attn_res_block_mix, attn_res_merge
from kernels.attn_res.mix import attn_res_mix
from kernels.attn_res.naive import naive_attn_res_block_mix, naive_attn_res_merge, naive_attn_res_mix
from kernels.grad_sink import GradSink, sinked

__all__ = ["BlockMixture", "GradSink", "attn_res_block_mix", "attn_res_merge", "attn_res_mix",
           "naive_attn_res_block_mix", "naive_attn_res_merge", "naive_attn_res_mix", "sinked"]
