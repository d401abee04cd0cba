"""The loader's two failure types: a bad sample the ``skip`` policy may step over, and a fatal error it may not.

Both take a single message argument so that torch's DataLoader can re-raise them unchanged in the main process when a
worker raises them (it rebuilds the exception as ``type(message)``).
"""
from __future__ import annotations

__all__ = ["SampleError", "LoaderFatalError", "sample_error"]


class SampleError(RuntimeError):
    """One sample cannot be read or decoded; the message names its shard and key. ``skip`` replaces it."""


class LoaderFatalError(RuntimeError):
    """The loader cannot go on under any policy: a shard disagrees with the manifest, or too many samples in a row
    failed (which means a broken shard or a wrong decoder, not a few bad records)."""


def sample_error(shard: str, key: str, problem: str) -> SampleError:
    """The one message format for a bad sample, so logs and ``fail`` errors can be grepped by shard and key."""
    return SampleError(f"bad sample: shard {shard!r} key {key!r}: {problem}")
