"""From packed samples (``tokens.npy`` + ``PackedSampleMeta``) to the tensors ``LongweaveModel.forward`` takes:
labels under the loss-mask rule and ``cu_seqlens`` flattened over the batch."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from schemas.sample import LOSS_MASK_RULE
from tokenization.tokenizer import SpecialIds
from trainer.model.multimodal import IGNORE_INDEX

__all__ = ["text_labels", "flatten_cu_seqlens"]


def text_labels(tokens: np.ndarray, cu_seqlens: Sequence[int], special: SpecialIds,
                rule: str = LOSS_MASK_RULE) -> np.ndarray:
    """Labels int64 ``[seq_len]`` aligned with ``tokens`` uint32 ``[seq_len]`` (one sample): the token id where it is
    predicted, ``IGNORE_INDEX`` on image tokens, on padding (from ``cu_seqlens[-1]`` on) and on the first token of
    each piece (nothing precedes it inside its piece)."""
    if rule != LOSS_MASK_RULE:
        raise ValueError(f"rule: only {LOSS_MASK_RULE!r} is known, got {rule!r}")
    labels = tokens.astype(np.int64)
    labels[np.isin(tokens, special.image_ids)] = IGNORE_INDEX
    labels[cu_seqlens[-1]:] = IGNORE_INDEX
    labels[np.asarray(cu_seqlens[:-1], dtype=np.int64)] = IGNORE_INDEX
    return labels


def flatten_cu_seqlens(per_sample: Sequence[Sequence[int]], seq_len: int) -> torch.Tensor:
    """int32 ``[S+1]`` boundaries over ``len(per_sample) · seq_len`` flattened tokens: each sample's pieces shifted
    by its row offset, and its padding tail (when any) as one more segment, so every token has a segment."""
    bounds = [0]
    for row, cu in enumerate(per_sample):
        if cu[0] != 0 or cu[-1] > seq_len:
            raise ValueError(f"per_sample[{row}]: cu_seqlens must run from 0 to at most {seq_len}, got {list(cu)}")
        offset = row * seq_len
        bounds.extend(offset + int(c) for c in cu[1:])
        if cu[-1] < seq_len:
            bounds.append(offset + seq_len)
    return torch.tensor(bounds, dtype=torch.int32)
