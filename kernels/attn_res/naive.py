"""The AttnRes mixture's reference in PyTorch (the truth for the kernels' tests, and the CPU path)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def naive_attn_res_mix(sources: Sequence[torch.Tensor], inv_rms: Sequence[torch.Tensor], query: torch.Tensor,
                       weight: torch.Tensor | None = None, eps: float | None = None,
                       sinks: Sequence[object] | None = None) -> torch.Tensor:
    """``Σ_i softmax_i(w·RMSNorm(src_i)) src_i`` of sources ``[T, d]`` with their ``inv_rms`` float32 ``[T]``, for
    the pseudo-query w ``[d]``, in the sources' dtype; then ``RMSNorm`` with ``weight`` ``[d]`` and ``eps`` if given.
    ``sinks`` (the kernels' in-place gradient sums) is ignored: here autograd sums the same gradients.

    The logits and the sum are float32, yet autograd keeps only the sources (alive anyway) and the weights
    ``[T, n_src]``: at 1M tokens a float32 copy of every source would cost 4 GiB each, per sublayer."""
    w = query.to(sources[0].dtype)
    logits = torch.stack([(src @ w).float() * r for src, r in zip(sources, inv_rms)], dim=-1)  # [T, n_src]
    alpha = torch.softmax(logits, dim=-1)
    mixed = alpha[:, :1] * sources[0]  # float32
    for i, src in enumerate(sources[1:], 1):
        mixed = torch.addcmul(mixed, alpha[:, i:i + 1], src)
    mixed = mixed.to(sources[0].dtype)
    return mixed if weight is None else F.rms_norm(mixed, (weight.shape[0],), weight, eps)
