"""Committed autotuning picks: each GPU's best config per kernel and tuning key, taken from the results Triton keeps
in its cache (``TRITON_CACHE_AUTOTUNING``). A fresh machine (a new cluster node, a CI runner with a GPU, the device
machine of each session) then compiles one config per key instead of compiling and timing the whole space: the 8k
stage's first step spent 143-230 s tuning without a warm cache against 15-23 s with one (2026-12-04 to 12-07), and
72 s with this table and no cache against 163 s without either on an H100 (2026-12-07, BENCHMARKS.md).

A pick applies only where the GPU's name, the kernel's name, its tuning key (argument values and dtypes, as Triton
forms it) and the config itself all match the present space; anything else is tuned as before, so a stale table
costs time, never correctness. ``LONGWEAVE_TUNING=full`` ignores the table (to time the whole space again).

Refresh the table from a run's cache: ``python -m kernels.tuning_picks --cache .cache/triton --gpu "NVIDIA H200"``
(the device run does it, `devrun/mfu_8k.sh`)."""
from __future__ import annotations

import argparse
import functools
import json
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import triton

TABLE = Path(__file__).with_name("tuning_picks.json")
_FIELDS = ("kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg")
_timed: Counter[str] = Counter()  # kernel -> keys left to Triton's autotuner since the last drain_timed()


def describe(config: triton.Config | dict) -> dict:
    """The fields that identify a config, from a triton.Config or the dict Triton's cache stores for one."""
    fields = config if isinstance(config, dict) else config.__dict__
    return {name: fields.get(name) for name in _FIELDS}


def key_text(key: list | tuple) -> str:
    """A tuning key as the table stores it (JSON of Triton's key tuple: argument values, then tensor dtypes)."""
    return json.dumps(list(key))


def load(path: Path) -> dict:
    """A picks table (GPU → kernel → key → config); empty where there is no file."""
    return json.loads(path.read_text()) if path.exists() else {}


@functools.cache
def _table() -> dict:
    return load(TABLE)


@functools.cache
def _gpu() -> str | None:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def picks_for(kernel: str, gpu: str | None = None) -> dict[str, dict]:
    """Tuning key → config for one kernel on one GPU (the present one by default); empty when there is none."""
    gpu = gpu or _gpu()
    if gpu is None or os.environ.get("LONGWEAVE_TUNING") == "full":
        return {}
    return _table().get(gpu, {}).get(kernel, {})


def tuning_key(arg_names: list[str], keys: list[str], named_args: dict | None, kwargs: dict) -> tuple:
    """The key Triton's Autotuner.run forms (3.6 and 3.8): the key arguments' values, then every tensor's dtype."""
    given = {**(named_args or {}), **kwargs}  # Autotuner.warmup passes no named arguments
    args = {name: value for name, value in given.items() if name in arg_names}
    return tuple([args[k] for k in keys if k in args] + [str(v.dtype) for v in args.values() if hasattr(v, "dtype")])


def with_picks(kernel: str, arg_names: list[str], keys: list[str], prune: Callable | None) -> Callable:
    """An early_config_prune hook: the space (after ``prune``) cut to the committed pick for this GPU and key when the
    space holds it, else left whole. The table is read at the first launch, so importing a kernel starts no CUDA."""
    def hook(space: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        space = prune(space, named_args, **kwargs) if prune else space
        pick = picks_for(kernel).get(key_text(tuning_key(arg_names, keys, named_args, kwargs)))
        chosen = [c for c in space if describe(c) == pick]
        if not chosen and len(space) > 1:
            _timed[kernel] += 1
        return chosen[:1] or space
    return hook


def drain_timed() -> Counter[str]:
    """Kernel → keys left to Triton's autotuner since the last call for want of a pick (timed, or read from Triton's
    own cache where it holds them): the trainer logs them, with the command that records them."""
    timed = _timed.copy()
    _timed.clear()
    return timed


def record_command() -> str:
    """The command that merges this machine's tuning results into the committed table."""
    return f"python -m kernels.tuning_picks --cache {triton.knobs.cache.dir}"


def read_cache(cache: Path) -> dict[str, dict[str, dict]]:
    """kernel → tuning key → best config, from the ``*.autotune.json`` files of a Triton cache (the newest result
    wins where a kernel's source changed between runs)."""
    found: dict[str, dict[str, dict]] = {}
    for path in sorted(cache.glob("*/*.autotune.json"), key=lambda p: p.stat().st_mtime):
        entry = json.loads(path.read_text())
        # Triton keeps the least timing as it compares them: lists of quantiles, element by element.
        best = min(entry["configs_timings"], key=lambda ct: ct[1] if isinstance(ct[1], list) else [ct[1]])[0]
        kernel = path.name.removesuffix(".autotune.json")
        found.setdefault(kernel, {})[key_text(entry["key"])] = describe(best)
    return found


def merge(table: dict, gpu: str, found: dict[str, dict[str, dict]]) -> dict:
    """The table with ``found`` over the GPU's earlier picks (keys not tuned in this run keep their pick)."""
    merged = json.loads(json.dumps(table))
    for kernel, picks in found.items():
        merged.setdefault(gpu, {}).setdefault(kernel, {}).update(picks)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="a Triton cache folder (TRITON_CACHE_DIR)")
    parser.add_argument("--gpu", help="the GPU's name as torch.cuda.get_device_name() gives it (default: this one)")
    parser.add_argument("--output", type=Path, default=TABLE)
    args = parser.parse_args()
    gpu = args.gpu or _gpu()
    if gpu is None:
        parser.error("no GPU here: name the one that made the cache with --gpu")
    found = read_cache(args.cache)
    table = merge(load(args.output), gpu, found)
    args.output.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{gpu}: {sum(map(len, found.values()))} picks of {len(found)} kernels from {args.cache} -> {args.output}")


if __name__ == "__main__":
    main()
