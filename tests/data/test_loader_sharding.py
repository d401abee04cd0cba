"""The rank split is a pure function of (seed, epoch): shard-then-sample shuffles, equal batches per rank whatever
the shard sizes, and a remainder of less than one step dropped per epoch."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from trainer.data.sharding import Position, SamplePlan


def plan(counts: tuple[int, ...] = (1, 50, 7), **kwargs: int) -> SamplePlan:
    return SamplePlan(counts=counts, **{"seed": 3, "world_size": 2, "micro_batch": 2, **kwargs})


def test_order_is_a_seeded_permutation_that_changes_with_seed_and_epoch() -> None:
    p = plan()
    order = p.order(0)
    assert sorted(order.tolist()) == list(range(p.total))
    assert np.array_equal(order, plan().order(0))
    assert not np.array_equal(order, p.order(1))
    assert not np.array_equal(order, plan(seed=4).order(0))


def test_order_reads_one_shard_at_a_time_in_shuffled_order() -> None:
    counts = (5, 9, 3, 11)
    offsets = np.cumsum((0,) + counts)
    shard_of = np.searchsorted(offsets, plan(counts).order(0), side="right") - 1
    runs = [int(s) for i, s in enumerate(shard_of) if i == 0 or s != shard_of[i - 1]]
    assert sorted(runs) == [0, 1, 2, 3]  # each shard is one contiguous run
    first_shards = {int(np.searchsorted(offsets, plan(counts, seed=k).order(0)[0], side="right")) - 1
                    for k in range(8)}
    assert len(first_shards) > 1  # and the shard order itself depends on the seed


@pytest.mark.parametrize("counts,world,batch", [((1, 50), 2, 2), ((51,), 4, 1), ((3, 3, 3, 40), 3, 5)],
                         ids=["1+50-w2-b2", "51-w4-b1", "3x3+40-w3-b5"])
def test_every_rank_gets_the_same_batches_and_the_epoch_is_read_once(counts: tuple[int, ...], world: int,
                                                                     batch: int) -> None:
    p = plan(counts, world_size=world, micro_batch=batch)
    order = p.order(0)
    seen: dict[int, list[int]] = {r: [] for r in range(world)}
    for position in p.positions(Position(0, 0)):
        if position.epoch:
            break
        for r in range(world):
            seen[r].extend(order[list(p.rank_slots(position, r))].tolist())
    assert {len(v) for v in seen.values()} == {p.batches_per_epoch * batch}
    flat = [s for v in seen.values() for s in v]
    assert len(set(flat)) == len(flat)
    assert sorted(flat) == sorted(order[:len(flat)].tolist())  # the first steps' worth of the epoch's order
    assert p.total - len(flat) == p.total % (world * batch)  # only the remainder is dropped


def test_positions_count_samples_so_another_world_size_resumes_the_same_epoch() -> None:
    before, after = plan((40,), world_size=4, micro_batch=2), plan((40,), world_size=2, micro_batch=3)
    saved = Position(0, 8 * 3)
    read = [s for pos in itertools.takewhile(lambda pos: pos.epoch == 0, after.positions(saved))
            for r in range(2) for s in after.rank_slots(pos, r)]
    assert read == list(range(24, 24 + 6 * 2))  # (40 - 24) // 6 = 2 more steps, from where the old run stopped
    assert before.order(0).tolist() == after.order(0).tolist()


def test_substitutes_take_the_same_row_of_later_steps_wrapping_around() -> None:
    p = plan((10,))  # step = 4 samples
    assert list(itertools.islice(p.substitutes(7), 4)) == [1, 5, 9, 3]


def test_advance_wraps_to_the_next_epoch_before_a_partial_step() -> None:
    p = plan((10,))
    assert p.advance(Position(0, 4)) == Position(1, 0)
    assert p.normalize(Position(2, 7)) == Position(3, 0)


@pytest.mark.parametrize("kwargs,match", [
    ({"counts": ()}, "counts"), ({"world_size": 0}, "world_size"), ({"micro_batch": 0}, "micro_batch"),
    ({"seed": -1}, "seed"), ({"counts": (3,)}, "cannot fill one step"),
])
def test_bad_plans_name_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplePlan(**{"counts": (10,), "seed": 0, "world_size": 2, "micro_batch": 2, **kwargs})
