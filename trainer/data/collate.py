"""From decoded samples to the batch dict ``LongweaveModel.forward`` takes.

Keys, shapes, dtypes (``B`` = micro-batch, ``L`` = seq_len):

- ``input_ids`` int64 ``[B, L]``: the token ids, padding included.
- ``labels`` int64 ``[B, L]``: ``input_ids`` with ``-100`` (``IGNORE_INDEX``) wherever the loss-mask rule
  ``text-only/v1`` ignores a token (image start/pad/end, padding, first token of each piece).
- ``cu_seqlens`` int32 ``[S + 1]``: piece boundaries over the ``B·L`` flattened tokens, each row's padding tail as one
  more segment, so it runs from 0 to ``B·L`` and every token has a segment.
- ``pixel_values`` float32 ``[N_patches, 588]``: every image's 14×14 patches, images in order of appearance (row by
  row, span by span), patches in the merger's order (see :mod:`vision.preprocess`); ``[0, 588]`` without images.
- ``image_grid`` int64 ``[N_images, 2]``: the **merged** grid ``(rows, cols)`` of each image (one token per 28×28
  pixels; the patch grid is twice that per side, and ``N_patches = 4 · Σ rows · cols``).
- ``image_token_positions`` int64 ``[Σ rows · cols]``: the flattened ``B·L`` index of every ``<|image_pad|>`` token,
  in the same order as the merged patches, so ``hidden.view(-1, d)[image_token_positions] = image_embeddings``.
- ``sample_keys`` ``list[str]`` of ``B``: which sample each row is (for error messages and data audits).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tokenization.tokenizer import SpecialIds
from trainer.data.decode import DecodedSample
from trainer.model.batch import flatten_cu_seqlens, text_labels
from vision.preprocess import batch_images, patch_dim

__all__ = ["BATCH_KEYS", "collate"]

BATCH_KEYS = ("input_ids", "labels", "cu_seqlens", "pixel_values", "image_grid", "image_token_positions",
              "sample_keys")


def collate(samples: Sequence[DecodedSample], special: SpecialIds) -> dict[str, Any]:
    """The batch dict of ``samples`` (one row each, in order); all samples must share one ``seq_len``."""
    if not samples:
        raise ValueError("samples: need at least one sample to collate")
    seq_len = samples[0].meta.seq_len
    if any(s.meta.seq_len != seq_len for s in samples):
        raise ValueError(f"samples: mixed seq_len {sorted({s.meta.seq_len for s in samples})}")
    tokens = np.stack([s.tokens for s in samples])
    labels = np.stack([text_labels(s.tokens, s.meta.cu_seqlens, special) for s in samples])
    images = [image for s in samples for image in s.images]
    if images:
        pixel_values, image_grid = batch_images(images)
    else:
        pixel_values = torch.zeros((0, patch_dim()), dtype=torch.float32)
        image_grid = torch.zeros((0, 2), dtype=torch.int64)
    positions = [np.arange(row * seq_len + span.start, row * seq_len + span.start + span.n_tokens, dtype=np.int64)
                 for row, s in enumerate(samples) for span in s.meta.image_spans]
    return {
        "input_ids": torch.from_numpy(tokens.astype(np.int64)),
        "labels": torch.from_numpy(labels),
        "cu_seqlens": flatten_cu_seqlens([s.meta.cu_seqlens for s in samples], seq_len),
        "pixel_values": pixel_values,
        "image_grid": image_grid,
        "image_token_positions": torch.from_numpy(np.concatenate(positions) if positions else np.zeros(0, np.int64)),
        "sample_keys": [s.key for s in samples],
    }
