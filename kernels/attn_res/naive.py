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


def naive_attn_res_block_mix(sources: Sequence[torch.Tensor], inv_rms: Sequence[torch.Tensor],
                             queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The finished blocks' part of every mixture of one block at once: for each pseudo-query ``queries[l]`` of
    ``[S, d]``, ``o_l = Σ_i softmax_i(s_li) src_i`` (sources' dtype) and ``lse_l = logsumexp_i s_li`` float32, with
    ``s_li = q_l·RMSNorm(src_i)``: ``[S, T, d]`` and ``[S, T]``."""
    x = torch.stack(list(sources))                                          # [N, T, d]
    logits = torch.einsum("ntd,sd->stn", x.float(), queries.float()) * torch.stack(list(inv_rms)).T  # [S, T, N]
    mixed = torch.einsum("stn,ntd->std", torch.softmax(logits, dim=-1), x.float())
    return mixed.to(sources[0].dtype), torch.logsumexp(logits, dim=-1)


def naive_attn_res_merge(mixed: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor | None,
                         partial_rms: torch.Tensor | None, query: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> torch.Tensor:
    """One sublayer's normed input from its finished blocks' part (``mixed`` ``[T, d]`` and its ``lse`` ``[T]``, of
    :func:`naive_attn_res_block_mix`) and the open block ``partial`` (None before the block's first add): the
    softmax over all sources is the two parts' weighted by ``sigmoid(lse − s_p)``, then ``RMSNorm`` with ``weight``.
    Equal to ``naive_attn_res_mix(finished + [partial], …)`` up to the rounding of ``mixed``."""
    if partial is None:
        total = mixed
    else:
        s_p = (partial.float() @ query.float()) * partial_rms
        gap = (lse - s_p)[:, None]
        total = (torch.sigmoid(gap) * mixed.float() + torch.sigmoid(-gap) * partial.float()).to(mixed.dtype)
    return F.rms_norm(total, (weight.shape[0],), weight, eps)
