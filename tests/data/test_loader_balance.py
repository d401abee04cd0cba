"""Uneven shards (1 sample and 50 samples) still give every rank the same number of full batches per epoch."""
from __future__ import annotations

import itertools
from typing import Any

import pytest

from trainer.data import build_loader


@pytest.mark.parametrize("world,batch,workers", [(2, 2, 2), (3, 1, 0)], ids=["w2-b2-2workers", "w3-b1-0workers"])
def test_uneven_shards_give_equal_batch_counts_per_rank(make_stage: Any, world: int, batch: int,
                                                        workers: int) -> None:
    stage = make_stage([1, 50])
    per_rank = []
    for rank in range(world):
        loader = build_loader(stage, rank, world, workers, 5, batch)
        assert loader.batches_per_epoch == 51 // (world * batch)
        batches = list(itertools.islice(iter(loader), loader.batches_per_epoch))
        assert all(len(b["sample_keys"]) == batch and b["input_ids"].shape[0] == batch for b in batches)
        assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["offset"] == 0  # that was the whole epoch
        per_rank.append([k for b in batches for k in b["sample_keys"]])
    assert len({len(keys) for keys in per_rank}) == 1
    seen = [k for keys in per_rank for k in keys]
    assert len(seen) == len(set(seen)) == 51 - 51 % (world * batch)  # disjoint; only the remainder dropped
