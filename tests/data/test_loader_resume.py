"""Exact resume: a loader restored from ``state_dict()`` yields exactly the batches the uninterrupted loader yields
next — on every rank, with the same or another number of workers — and an epoch reads every sample once."""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.data import BATCH_KEYS, build_loader

WORLD, BATCH, SEED = 2, 2, 11
SIZES = [7, 20, 13, 8]  # 48 samples: 12 batches per rank per epoch


def take(loader: Any, n: int) -> list[dict[str, Any]]:
    return list(itertools.islice(iter(loader), n))


def assert_same_batches(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert set(a) == set(b) == set(BATCH_KEYS), i
        assert a["sample_keys"] == b["sample_keys"], i
        for name in BATCH_KEYS[:-1]:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), (i, name)


@pytest.fixture
def stage(make_stage: Any) -> Path:
    return make_stage(SIZES)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # 3 workers on 2 cores
def test_restore_after_n_batches_continues_exactly_with_2_or_3_workers(stage: Path) -> None:
    head, tail = 5, 10  # 15 batches: the resumed part crosses into epoch 1
    full = {rank: take(build_loader(stage, rank, WORLD, 2, SEED, BATCH), head + tail) for rank in range(WORLD)}
    for rank in range(WORLD):
        first = build_loader(stage, rank, WORLD, 2, SEED, BATCH)
        assert_same_batches(list(first.batches(head)), full[rank][:head])  # a bounded run: exactly `head` batches
        state = json.loads(json.dumps(first.state_dict()))  # plain JSON, as a checkpoint stores it
        assert (state["epoch"], state["offset"]) == (0, head * WORLD * BATCH)
        for workers in (2, 3):
            restored = build_loader(stage, rank, WORLD, workers, SEED, BATCH)
            restored.load_state_dict(state)
            assert_same_batches(take(restored, tail), full[rank][head:])
            assert restored.state_dict()["epoch"] == 1

    per_epoch = sum(SIZES) // (WORLD * BATCH)
    epoch0 = [k for rank in range(WORLD) for b in full[rank][:per_epoch] for k in b["sample_keys"]]
    assert len(epoch0) == len(set(epoch0)) == sum(SIZES)  # every sample of the epoch exactly once across ranks
    epoch1 = [k for b in full[0][per_epoch:] for k in b["sample_keys"]]
    assert epoch1 != [k for b in full[0][:len(epoch1) // BATCH] for k in b["sample_keys"]]  # reshuffled


def test_restore_with_another_world_size_reads_the_rest_of_the_epoch_once(stage: Path) -> None:
    ranks = [build_loader(stage, rank, WORLD, 0, SEED, BATCH) for rank in range(WORLD)]
    before = [k for loader in ranks for b in take(loader, 3) for k in b["sample_keys"]]
    single = build_loader(stage, 0, 1, 1, SEED, 4)
    single.load_state_dict(ranks[0].state_dict())
    after = [k for b in take(single, (sum(SIZES) - len(before)) // 4) for k in b["sample_keys"]]
    assert single.state_dict()["epoch"] == 1
    assert len(before + after) == len(set(before + after)) == sum(SIZES)


def test_wrong_state_fails_loudly(stage: Path, make_stage: Any) -> None:
    loader = build_loader(stage, 0, WORLD, 0, SEED, BATCH)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="not a StreamingLoader state"):
        loader.load_state_dict({**state, "class": "WebLoader"})
    with pytest.raises(ValueError, match="state.seed"):
        build_loader(stage, 0, WORLD, 0, SEED + 1, BATCH).load_state_dict(state)
    with pytest.raises(ValueError, match="state.manifest_sha256"):
        build_loader(make_stage([48], name="other"), 0, WORLD, 0, SEED, BATCH).load_state_dict(state)
    with pytest.raises(ValueError, match="state.offset"):
        loader.load_state_dict({**state, "offset": -4})


def test_a_new_iterator_retires_the_old_one(stage: Path) -> None:
    loader = build_loader(stage, 0, WORLD, 0, SEED, BATCH)
    old = iter(loader)
    first = next(old)
    new = iter(loader)
    assert next(new)["sample_keys"] != first["sample_keys"]  # continues from the position, not from the start
    with pytest.raises(RuntimeError, match="replaced"):
        next(old)
    with pytest.raises(ValueError, match="batches.count"):
        loader.batches(-1)


@pytest.mark.parametrize("kwargs,match", [
    ({"rank": 2}, "LoaderConfig.rank"), ({"policy": "ignore"}, "LoaderConfig.policy"),
    ({"num_workers": -1}, "LoaderConfig.num_workers"), ({"timeout_s": -1.0}, "LoaderConfig.timeout_s"),
    ({"micro_batch": 100}, "cannot fill one step"),
])
def test_bad_loader_configs_name_the_field(stage: Path, kwargs: dict, match: str) -> None:
    args = {"rank": 0, "world_size": WORLD, "num_workers": 0, "seed": SEED, "micro_batch": BATCH, **kwargs}
    with pytest.raises(ValueError, match=match):
        build_loader(stage, **args)


def test_a_manifest_from_another_tokenizer_is_refused(stage: Path) -> None:
    manifest = json.loads(stage.read_text())
    manifest["tokenizer_fingerprint"] = "0" * 64
    stage.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="tokenizer_path.*fingerprint mismatch"):
        build_loader(stage, 0, WORLD, 0, SEED, BATCH)
