"""A synthetic packed batch shaped like real stage data (documents of log-normal lengths, two images, a padding
tail), for the model's GPU test and its profiler: no shards needed."""
from __future__ import annotations

import torch

from tokenization import load_tokenizer
from trainer.model.batch import flatten_cu_seqlens, text_labels

SPECIAL = load_tokenizer().special
IMAGE_GRIDS = [(16, 16), (12, 20)]


def synthetic_batch(seq_len: int, generator: torch.Generator, device: str = "cuda") -> tuple[dict, list[int]]:
    """One row: a 2048-token document holding two images, random-length documents after it, a padding tail.
    Returns the batch and the segment lengths (padding included) for the FLOP count. The image patches are on
    ``device``, the rest on the host, as the trainer passes them (``trainer.train.model_inputs``)."""
    lengths = [2048]
    while sum(lengths) < seq_len - 600:
        n = 64 + int(torch.empty(()).log_normal_(7.0, 1.0, generator=generator))
        lengths.append(min(n, seq_len - 100 - sum(lengths)))
    used = sum(lengths)
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    ids = torch.randint(6, 32768, (seq_len,), generator=generator)
    ids[used:] = SPECIAL.pad
    at = 8
    for rows, cols in IMAGE_GRIDS:
        ids[at], ids[at + 1:at + 1 + rows * cols], ids[at + 1 + rows * cols] = (
            SPECIAL.image_start, SPECIAL.image_pad, SPECIAL.image_end)
        at += rows * cols + 10
    labels = torch.from_numpy(text_labels(ids.numpy().astype("uint32"), cu, SPECIAL))
    patches = sum(4 * r * c for r, c in IMAGE_GRIDS)
    batch = {
        "input_ids": ids[None],
        "labels": labels[None],
        "cu_seqlens": flatten_cu_seqlens([cu], seq_len),
        "pixel_values": torch.randn(patches, 588, generator=generator),
        "image_grid": torch.tensor(IMAGE_GRIDS),
    }
    batch["pixel_values"] = batch["pixel_values"].to(device)
    return batch, lengths + [seq_len - used]
