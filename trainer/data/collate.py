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

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from tokenization.tokenizer import SpecialIds
from trainer.data.decode import DecodedSample
from trainer.model.batch import flatten_cu_seqlens, text_labels
from vision.preprocess import patch_dim

__all__ = ["BATCH_KEYS", "collate"]

BATCH_KEYS = ("input_ids", "labels", "cu_seqlens", "pixel_values", "image_grid", "image_token_positions",
              "sample_keys")


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised output tensor; inside a DataLoader worker, allocated in shared memory (as torch's own
    ``default_collate`` does), so handing the batch to the main process is no extra copy. At 1M tokens a batch holds
    hundreds of MB of patches, and that copy alone measured ≈ 15% of the loader's time."""
    numel = math.prod(shape)
    if get_worker_info() is None or numel == 0:
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(numel * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def collate(samples: Sequence[DecodedSample], special: SpecialIds) -> dict[str, Any]:
    """The batch dict of ``samples`` (one row each, in order); all samples must share one ``seq_len``."""
    if not samples:
        raise ValueError("samples: need at least one sample to collate")
    seq_len = samples[0].meta.seq_len
    if any(s.meta.seq_len != seq_len for s in samples):
        raise ValueError(f"samples: mixed seq_len {sorted({s.meta.seq_len for s in samples})}")
    input_ids, labels = _empty((len(samples), seq_len), torch.int64), _empty((len(samples), seq_len), torch.int64)
    for row, sample in enumerate(samples):
        input_ids.numpy()[row] = sample.tokens
        labels.numpy()[row] = text_labels(sample.tokens, sample.meta.cu_seqlens, special)
    patches = [image.patches for s in samples for image in s.images]
    pixel_values = _empty((sum(p.shape[0] for p in patches), patch_dim()), torch.float32)
    if patches:
        torch.cat(patches, out=pixel_values)
    grids = [image.grid for s in samples for image in s.images]
    positions = [np.arange(row * seq_len + span.start, row * seq_len + span.start + span.n_tokens, dtype=np.int64)
                 for row, s in enumerate(samples) for span in s.meta.image_spans]
    return {
        "input_ids": input_ids,
        "labels": labels,
        "cu_seqlens": flatten_cu_seqlens([s.meta.cu_seqlens for s in samples], seq_len),
        "pixel_values": pixel_values,
        "image_grid": torch.tensor(grids, dtype=torch.int64).reshape(len(grids), 2),
        "image_token_positions": torch.from_numpy(np.concatenate(positions) if positions else np.zeros(0, np.int64)),
        "sample_keys": [s.key for s in samples],
    }
