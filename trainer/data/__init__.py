"""The streaming loader: a stage's WebDataset shards → packed, rank-balanced, exactly resumable training batches.

Use :func:`build_loader`; the batch dict is described in :mod:`trainer.data.collate`, the split over ranks in
:mod:`trainer.data.sharding`, state and bad-sample policy in :mod:`trainer.data.loader`.
"""
from trainer.data.collate import BATCH_KEYS
from trainer.data.errors import LoaderFatalError, SampleError
from trainer.data.loader import POLICIES, LoaderConfig, StreamingLoader, build_loader

__all__ = ["BATCH_KEYS", "POLICIES", "LoaderConfig", "LoaderFatalError", "SampleError", "StreamingLoader",
           "build_loader"]
