"""``build_loader``: one stage's shards as an endless stream of packed batches for one rank, exactly resumable.

How exact resume works: the samples of every batch are a pure function of ``(seed, epoch, position, rank)``
(:mod:`trainer.data.sharding`), so the loader's whole state is its position — the epoch and how many samples of the
epoch's order all ranks have consumed — plus the skip counter. Workers take the batches of the stream round-robin
(worker ``w`` of ``W`` builds batches ``w, w + W, …`` counted from the position the iterator started at), and the
DataLoader hands results back in task order, which is the same round-robin, so the main process sees batches in
stream order whatever ``num_workers`` is; the position advances in the main process as each batch is handed out.
Nothing random is drawn anywhere else, so there is no per-worker generator state to save.

Bad samples (:class:`~trainer.data.errors.SampleError`): ``policy="fail"`` raises, naming shard and key.
``policy="skip"`` logs shard, key and reason, counts the skip (``loader.skipped``, saved in the state), and fills the
row with the sample that stands in for it (:meth:`SamplePlan.substitutes`: the same row of this rank's next steps), so
every rank still gets full batches and the same number of them. More than ``max_consecutive_failures`` bad samples in
a row within one worker's stream raise :class:`~trainer.data.errors.LoaderFatalError`: that is a broken shard or
decoder, not a few bad records. Shard-level problems (missing file, size or count unlike the manifest) are fatal under
either policy.

Stage transition: build a new loader on the next stage's manifest (its position starts at epoch 0, offset 0). A state
saved on one manifest refuses to load into a loader on another (the manifest's sha256 is part of the state).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from tokenization.tokenizer import SpecialIds, load_tokenizer
from trainer.data.collate import collate
from trainer.data.decode import DecodedSample, decode_sample
from trainer.data.errors import LoaderFatalError, SampleError
from trainer.data.manifest_source import ManifestSource
from trainer.data.sharding import Position, SamplePlan
from trainer.data.tar_index import ShardReader
from vision.geometry import DEFAULT_POLICY

__all__ = ["POLICIES", "LoaderConfig", "StreamingLoader", "build_loader"]

log = logging.getLogger(__name__)

POLICIES = ("fail", "skip")
_STATE_VERSION = 1
# The error message (naming shard and key) of each sample a batch skipped, sent to the main process beside the batch.
Skipped = list[str]


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{owner}.{name}: must be an int >= {minimum}, got {value!r}")


@dataclasses.dataclass(kw_only=True, slots=True)
class LoaderConfig:
    """One rank's loader. ``timeout_s`` bounds the wait for one batch from the workers (0 = forever), so a worker
    stuck on a dead filesystem fails the job instead of hanging every rank. Up to ``num_workers × prefetch_factor``
    batches are in flight (in shared memory): at 1M tokens one batch's patches can reach about 1 GB. ``tokenizer_path``
    (default: the shipped tokenizer) must be the one the shards were packed with; its fingerprint is checked against
    the manifest."""

    manifest_path: str
    rank: int = 0
    world_size: int = 1
    num_workers: int = 2
    seed: int = 0
    micro_batch: int = 1
    policy: str = "fail"
    max_consecutive_failures: int = 16
    prefetch_factor: int = 2
    timeout_s: float = 300.0
    tokenizer_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.manifest_path, (str, Path)) or not str(self.manifest_path):
            raise ValueError(f"LoaderConfig.manifest_path: must be a path, got {self.manifest_path!r}")
        for name, minimum in (("world_size", 1), ("rank", 0), ("num_workers", 0), ("seed", 0), ("micro_batch", 1),
                              ("max_consecutive_failures", 0), ("prefetch_factor", 1)):
            _check_int("LoaderConfig", name, getattr(self, name), minimum)
        if self.rank >= self.world_size:
            raise ValueError(f"LoaderConfig.rank: must be < world_size {self.world_size}, got {self.rank}")
        if self.policy not in POLICIES:
            raise ValueError(f"LoaderConfig.policy: must be one of {POLICIES}, got {self.policy!r}")
        if not isinstance(self.timeout_s, (int, float)) or self.timeout_s < 0:
            raise ValueError(f"LoaderConfig.timeout_s: must be a number >= 0, got {self.timeout_s!r}")


class _BatchStream(IterableDataset):
    """The batches of one rank from ``start`` on, split round-robin over the DataLoader's workers. Yields
    ``(batch dict, skipped)``. Each worker gets its own copy (and its own :class:`ShardReader`) after the fork."""

    def __init__(self, *, source: ManifestSource, plan: SamplePlan, config: LoaderConfig, special: SpecialIds,
                 start: Position, count: int | None) -> None:
        self.source = source
        self.plan = plan
        self.config = config
        self.special = special
        self.start = start
        self.count = count  # batches in the whole stream (all workers); None = endless
        self._consecutive = 0  # bad samples in a row in this worker's stream

    def __iter__(self) -> Iterator[tuple[dict[str, Any], Skipped]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        reader = ShardReader(self.source.shards)
        self._consecutive = 0
        epoch, order = -1, np.zeros(0, dtype=np.int64)
        for k, position in enumerate(itertools.islice(self.plan.positions(self.start), self.count)):
            if k % workers != worker:
                continue
            if position.epoch != epoch:
                epoch, order = position.epoch, self.plan.order(position.epoch)
            skipped: Skipped = []
            rows = [self._row(reader, order, slot, skipped)
                    for slot in self.plan.rank_slots(position, self.config.rank)]
            yield collate(rows, self.special), skipped

    def _row(self, reader: ShardReader, order: np.ndarray, slot: int, skipped: Skipped) -> DecodedSample:
        """The sample at epoch-order index ``slot``, or under ``skip`` its first decodable substitute."""
        candidates = iter(self.plan.substitutes(slot))
        while True:
            shard, index = self.source.locate(int(order[slot]))
            try:
                key, members = reader.read(shard, index)
                sample = decode_sample(members, shard=self.source.shards[shard].name, key=key,
                                       seq_len=self.source.seq_len, special=self.special)
            except SampleError as exc:
                if self.config.policy == "fail":
                    raise
                self._consecutive += 1
                if self._consecutive > self.config.max_consecutive_failures:
                    raise LoaderFatalError(f"{self._consecutive} bad samples in a row (max_consecutive_failures "
                                           f"{self.config.max_consecutive_failures}); last: {exc}") from exc
                skipped.append(str(exc))
                slot = next(candidates)
                continue
            self._consecutive = 0
            return sample


class StreamingLoader:
    """Iterating gives this rank's batches (see :mod:`trainer.data.collate` for the dict) from the current position
    on, endlessly across epochs; the trainer stops on its own step or token budget. ``state_dict()`` after any
    number of batches, restored into a fresh loader, continues with exactly the batches this one would have yielded
    next. One live iterator at a time: a new ``iter()`` starts from the current position and retires the old one."""

    def __init__(self, config: LoaderConfig) -> None:
        self.config = config
        self.source = ManifestSource(config.manifest_path)
        tokenizer = load_tokenizer(config.tokenizer_path)
        manifest = self.source.manifest
        if tokenizer.fingerprint(DEFAULT_POLICY) != manifest.tokenizer_fingerprint:
            raise ValueError(f"LoaderConfig.tokenizer_path: tokenizer {str(tokenizer.path)!r} is not the one the "
                             f"shards of {str(self.source.path)!r} were packed with (fingerprint mismatch)")
        if DEFAULT_POLICY.fingerprint() != manifest.vision_fingerprint:
            raise ValueError(f"manifest_path: {str(self.source.path)!r} was packed under another vision policy")
        self.special = tokenizer.special
        self.plan = SamplePlan(counts=self.source.counts, seed=config.seed, world_size=config.world_size,
                               micro_batch=config.micro_batch)
        self.position = Position(0, 0)
        self.skipped = 0
        self._generation = 0

    @property
    def batches_per_epoch(self) -> int:
        """Batches every rank gets per epoch (the same on all ranks)."""
        return self.plan.batches_per_epoch

    @property
    def seq_len(self) -> int:
        return self.source.seq_len

    def _data_loader(self, count: int | None) -> DataLoader:
        workers = self.config.num_workers
        stream = _BatchStream(source=self.source, plan=self.plan, config=self.config, special=self.special,
                              start=self.position, count=count)
        return DataLoader(stream, batch_size=None, num_workers=workers, pin_memory=torch.cuda.is_available(),
                          prefetch_factor=self.config.prefetch_factor if workers else None,
                          timeout=self.config.timeout_s if workers else 0, in_order=True)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.batches()

    def batches(self, count: int | None = None) -> Iterator[dict[str, Any]]:
        """The next ``count`` batches (``None``: endless, as ``iter(loader)``). With a count the workers build exactly
        those batches and stop, so a stage that ends after a known number of micro-steps decodes nothing past it."""
        if count is not None:
            _check_int("batches", "count", count, 0)
        self._generation += 1
        return self._stream(count, self._generation)

    def _stream(self, count: int | None, generation: int) -> Iterator[dict[str, Any]]:
        batches = iter(self._data_loader(count))
        try:
            for batch, skipped in batches:
                if generation != self._generation:
                    raise RuntimeError("StreamingLoader: this iterator was replaced by a newer iter(loader)")
                for message in skipped:
                    log.warning("skip policy: %s (a substitute fills its row)", message)
                self.skipped += len(skipped)
                self.position = self.plan.advance(self.position)
                yield batch
        finally:
            # Stop the workers now, on every exit (done, dropped, or an error). Left to the iterator's __del__, an
            # error's traceback keeps it alive until a garbage-collection pass, where torch's shutdown (measured,
            # torch 2.14) waits out its 5 s status interval per worker before the worker sees the stop signal.
            shutdown = getattr(batches, "_shutdown_workers", None)  # only the multi-process iterator has workers
            if shutdown is not None:
                shutdown()

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state: class tag, format version, what the order depends on, and the position. The position
        is the same on every rank (it counts the samples of all ranks), so any one rank's state restores them all;
        only ``skipped`` is this rank's own count."""
        return {
            "class": type(self).__name__,
            "version": _STATE_VERSION,
            "manifest_sha256": self.source.fingerprint,
            "stage": self.source.stage,
            "seed": self.config.seed,
            "world_size": self.config.world_size,
            "micro_batch": self.config.micro_batch,
            "epoch": self.position.epoch,
            "offset": self.position.offset,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. Fails loudly on another class's state, another manifest or another seed
        (the sample order would differ). A different ``world_size`` or ``micro_batch`` is allowed: the rest of the
        epoch is split again from the saved sample offset."""
        if not isinstance(state, dict) or state.get("class") != type(self).__name__:
            raise ValueError(f"state: not a {type(self).__name__} state (class {state.get('class')!r})"
                             if isinstance(state, dict) else f"state: must be a dict, got {type(state).__name__}")
        expected = {"version": _STATE_VERSION, "manifest_sha256": self.source.fingerprint, "seed": self.config.seed}
        for name, value in expected.items():
            if state.get(name) != value:
                raise ValueError(f"state.{name}: saved {state.get(name)!r}, this loader has {value!r}")
        for name in ("epoch", "offset", "skipped"):
            _check_int("state", name, state.get(name), 0)
        if (state.get("world_size"), state.get("micro_batch")) != (self.config.world_size, self.config.micro_batch):
            log.info("loader restored with world_size×micro_batch %s×%s (saved %s×%s): rest of epoch re-split",
                     self.config.world_size, self.config.micro_batch, state.get("world_size"),
                     state.get("micro_batch"))
        self.position = self.plan.normalize(Position(state["epoch"], state["offset"]))
        self.skipped = state["skipped"]
        self._generation += 1


def build_loader(manifest_path: str | Path, rank: int, world_size: int, num_workers: int, seed: int,
                 micro_batch: int, policy: str = "fail", **options: Any) -> StreamingLoader:
    """The loader of rank ``rank`` over the stage whose ``manifest.json`` (or stage folder) is ``manifest_path``.
    ``options`` are the other :class:`LoaderConfig` fields (``max_consecutive_failures``, ``timeout_s``, …)."""
    return StreamingLoader(LoaderConfig(manifest_path=str(manifest_path), rank=rank, world_size=world_size,
                                        num_workers=num_workers, seed=seed, micro_batch=micro_batch, policy=policy,
                                        **options))
