"""Which samples each rank reads at each step: a pure function of ``(seed, epoch)`` and the per-shard counts.

Epoch order: the shards in an order shuffled from ``(seed, epoch)``, and inside each shard its samples in an order
shuffled from the same generator; the concatenation is the epoch's global order ``order[0 .. N)``. Shuffling at both
levels keeps reads local to one shard at a time (like webdataset's shard shuffle) while no two epochs repeat.

Steps: one step takes the next ``world_size · micro_batch`` samples of the global order, and rank ``r`` takes the
``r``-th run of ``micro_batch`` of them. A loader position is ``(epoch, offset)``: the number of samples of the epoch's
order that all ranks together have consumed. Every rank therefore gets exactly ``N // (world_size · micro_batch)``
batches per epoch, whatever the shard sizes. **Remainder**: the last ``N mod (world_size · micro_batch)`` samples of
each epoch's order are dropped (fewer than one step); the order is reshuffled every epoch, so which samples are
dropped changes from epoch to epoch and none is dropped for good.

Because a position counts samples, not batches, a run saved at step ``s`` can also resume with a different
``world_size`` or ``micro_batch``: the remaining samples of the epoch are split again from the saved offset.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["Position", "SamplePlan"]


@dataclasses.dataclass(frozen=True, slots=True)
class Position:
    """``offset`` samples of epoch ``epoch``'s global order are consumed (by all ranks together)."""

    epoch: int
    offset: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SamplePlan:
    """The split of a stage's samples over ranks. Global sample ids number samples shard by shard in manifest order
    (``counts`` samples per shard)."""

    counts: tuple[int, ...]
    seed: int
    world_size: int
    micro_batch: int

    def __post_init__(self) -> None:
        if not self.counts or any(not isinstance(c, int) or c < 0 for c in self.counts):
            raise ValueError(f"SamplePlan.counts: must be non-negative ints, one per shard, got {self.counts!r}")
        for name in ("world_size", "micro_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SamplePlan.{name}: must be an int >= 1, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"SamplePlan.seed: must be an int >= 0, got {self.seed!r}")
        if self.batches_per_epoch < 1:
            raise ValueError(f"SamplePlan.micro_batch: {self.total} samples cannot fill one step of world_size "
                             f"{self.world_size} × micro_batch {self.micro_batch}")

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def step_samples(self) -> int:
        """Samples consumed by one step of all ranks."""
        return self.world_size * self.micro_batch

    @property
    def batches_per_epoch(self) -> int:
        """Batches each rank gets in an epoch read from its start."""
        return self.total // self.step_samples

    def order(self, epoch: int) -> np.ndarray:
        """Global sample ids int64 ``[N]`` in epoch ``epoch``'s order (shard order, then in-shard order)."""
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
        offsets = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        parts = [offsets[s] + rng.permutation(self.counts[s]) for s in rng.permutation(len(self.counts))]
        return np.concatenate(parts).astype(np.int64)

    def normalize(self, position: Position) -> Position:
        """``position``, or the start of the next epoch when less than one step is left in this one."""
        if position.epoch < 0 or not 0 <= position.offset <= self.total:
            raise ValueError(f"position: epoch must be >= 0 and offset in [0, {self.total}], got {position}")
        if self.total - position.offset < self.step_samples:
            return Position(position.epoch + 1, 0)
        return position

    def advance(self, position: Position) -> Position:
        """The position after one more step."""
        position = self.normalize(position)
        return self.normalize(Position(position.epoch, position.offset + self.step_samples))

    def positions(self, start: Position) -> Iterator[Position]:
        """The (endless) positions of successive steps from ``start``: batch ``k`` of every rank is read at the
        ``k``-th of them."""
        position = self.normalize(start)
        while True:
            yield position
            position = self.advance(position)

    def rank_slots(self, position: Position, rank: int) -> Sequence[int]:
        """Epoch-order indices of rank ``rank``'s ``micro_batch`` samples at the step read at ``position``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank: must lie in [0, {self.world_size}), got {rank}")
        first = position.offset + rank * self.micro_batch
        return range(first, first + self.micro_batch)

    def substitutes(self, slot: int) -> Iterator[int]:
        """Epoch-order indices that stand in for a skipped sample at ``slot``: the same row of the same rank's next
        steps (``slot + k · step_samples``, wrapping around the epoch's order, dropped remainder included).

        A substitute is thus a sample this epoch reads elsewhere (or drops), so a skip repeats one sample instead of
        shortening the batch or giving one rank fewer batches than the others."""
        for k in itertools.count(1):  # endless: the consecutive-failure bound of the caller ends a bad run
            yield (slot + k * self.step_samples) % self.total
