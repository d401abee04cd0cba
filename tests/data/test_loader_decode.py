"""Batches decode back to exactly the tokens and images that ``longweave inspect --sample KEY`` shows for their
samples (read through inspect's own reader, independent of the loader)."""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.inspect.sample_view import find_sample
from pipeline.inspect.target import resolve_target
from schemas.manifest import MANIFEST_NAME
from tokenization.tokenizer import load_tokenizer
from trainer.data import build_loader
from trainer.model.multimodal import IGNORE_INDEX
from vision.preprocess import image_to_patches, load_image


def expected_labels(tokens: np.ndarray, cu: tuple[int, ...]) -> np.ndarray:
    """The text-only/v1 rule written out: ignore image tokens, padding, and each piece's first token."""
    special = load_tokenizer().special
    labels = tokens.astype(np.int64)
    for position, token in enumerate(tokens):
        if token in special.image_ids or position >= cu[-1] or position in cu[:-1]:
            labels[position] = IGNORE_INDEX
    return labels


def test_batches_hold_the_samples_tokens_labels_and_images(pool: list, make_stage: Any) -> None:
    with_images = sorted((s for s in pool if s.images), key=lambda s: -len(s.images))[:3]
    without = [s for s in pool if not s.images][:3]
    stage = make_stage([6], samples=with_images + without)
    target = resolve_target(stage.parent)
    special = load_tokenizer().special

    loader = build_loader(stage, 0, 1, 2, 0, 3)
    batches = list(itertools.islice(iter(loader), 2))
    keys = [key for b in batches for key in b["sample_keys"]]
    assert sorted(keys) == sorted(f"s000-{i:04d}" for i in range(6))
    oracle = {key: find_sample(target, key) for key in keys}
    for batch in batches:
        seq_len = batch["input_ids"].shape[1]
        bounds, patches, grids, positions = [0], [], [], []
        for row, key in enumerate(batch["sample_keys"]):
            sample = oracle[key]
            assert torch.equal(batch["input_ids"][row], torch.from_numpy(sample.tokens.astype(np.int64)))
            assert np.array_equal(batch["labels"][row].numpy(), expected_labels(sample.tokens, sample.meta.cu_seqlens))
            cu = sample.meta.cu_seqlens
            bounds += [row * seq_len + c for c in cu[1:]] + ([(row + 1) * seq_len] if cu[-1] < seq_len else [])
            for span, data in zip(sample.meta.image_spans, sample.images):
                patches.append(image_to_patches(load_image(data)).patches)
                grids.append([span.grid_h, span.grid_w])
                positions += range(row * seq_len + span.start, row * seq_len + span.start + span.n_tokens)
        assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"].tolist() == bounds
        assert batch["image_grid"].tolist() == grids
        assert batch["image_token_positions"].tolist() == positions
        assert bool((batch["input_ids"].view(-1)[batch["image_token_positions"]] == special.image_pad).all())
        want = torch.cat(patches) if patches else torch.zeros((0, 588))
        assert batch["pixel_values"].shape == (4 * sum(h * w for h, w in grids), 588)
        assert torch.equal(batch["pixel_values"], want)
    assert any(b["image_grid"].shape[0] >= 2 for b in batches)


def test_the_pack_commands_own_output_loads(packed_small: Path) -> None:
    stage = packed_small / "8k"
    loader = build_loader(stage / MANIFEST_NAME, 0, 1, 0, 0, 1)
    batch = next(iter(loader))
    shown = find_sample(resolve_target(stage), batch["sample_keys"][0])
    assert torch.equal(batch["input_ids"][0], torch.from_numpy(shown.tokens.astype(np.int64)))
    assert loader.seq_len == 8192 and loader.batches_per_epoch == loader.source.manifest.total_samples
