"""Benchmark: the streaming loader against plain ``webdataset.WebDataset`` doing the same decoding over the same
shards, in the same run.

    python -m trainer.data.bench PACK_OUTPUT [--stages 8k,64k,256k,1m] [--workers 2] [--micro-batch 1]
                                 [--repeat 3] [--min-samples 16]

Per stage and round, each side reads the same number of full epochs (enough for ``--min-samples``: the small 256K and
1M stages hold a handful of samples, and one epoch of them measures start-up and worker split luck, not throughput)
through a torch DataLoader with the same number of workers, timed wall clock from ``iter()`` (worker start-up
included) to the arrival of the last sample. Both decode every sample with
:func:`trainer.data.decode.decode_sample` (``.npy`` tokens, ``meta.json``, JPEG → patches); the loader does the
extra work — seeded rank split, random access by tar offset, resumable position, collation into the batch dict
(labels, flattened ``cu_seqlens``, packed ``pixel_values``). webdataset splits shards over workers, so with as many
workers as shards its time follows the largest shard, while the loader splits samples; ``--workers 0`` compares the
per-sample work alone. The shards are read once first so both sides find them in the page cache; sides alternate
(which one goes first swaps every round), and the median round is reported. Tokens are ``samples × seq_len``
(padding included: what the trainer consumes).

    python -m trainer.data.bench PACK_OUTPUT --against-model small --stages 8k --workers 8 --micro-batch 16
                                 [--warmup-steps 1] [--model-steps 3] [--min-samples 512] [--repeat 3]

``--against-model PRESET`` compares the loader with the trainer's consumption instead, in one process: per stage, the
loader's tokens/s as above (whole epochs, median of ``--repeat`` rounds), then ``LongweaveModel(preset(PRESET))``
(bf16 on CUDA, fp32 on the CPU; the preset's own activation checkpointing) timed over forward + backward of
``--model-steps`` batches drawn from the same loader after ``--warmup-steps`` untimed ones (the first step compiles),
each timed from its inputs' host-to-device copy to a device synchronisation, no optimizer step. It prints both rates,
their ratio (the loader keeps up with the trainer while it is ≥ 1; the issue asks ≥ 10 for ``small`` at 8K), MFU and
peak memory, and one JSON line of the same figures.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import webdataset as wds
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader

from pipeline.inspect.bench import _warm as warm_page_cache  # the one copy of this helper
from schemas.manifest import MANIFEST_NAME
from tokenization.tokenizer import SpecialIds, load_tokenizer
from trainer.data.decode import DecodedSample, decode_sample
from trainer.data.loader import build_loader
from trainer.data.manifest_source import ManifestSource

log = logging.getLogger(__name__)


def _decode_raw(raw: dict[str, Any], *, seq_len: int, special: SpecialIds) -> DecodedSample:
    members = {name: data for name, data in raw.items() if not name.startswith("__")}
    return decode_sample(members, shard=raw["__url__"], key=raw["__key__"], seq_len=seq_len, special=special)


def _until_last(items: Iterable[int]) -> tuple[float, int]:
    """Seconds from now until the last item arrives, and the sum of the items (worker shutdown left out)."""
    started = time.perf_counter()
    total, last = 0, started
    for item in items:
        total += item
        last = time.perf_counter()
    return last - started, total


def webdataset_epochs(source: ManifestSource, epochs: int, workers: int, special: SpecialIds) -> tuple[float, int]:
    """Plain webdataset (no shard shuffle, its default shard split over workers), same decode: seconds, samples."""
    dataset = wds.WebDataset([s.path for s in source.shards], shardshuffle=False, empty_check=False)
    dataset = dataset.map(functools.partial(_decode_raw, seq_len=source.seq_len, special=special)).repeat(epochs)
    return _until_last(1 for _ in DataLoader(dataset, batch_size=None, num_workers=workers))


def loader_epochs(manifest: Path, epochs: int, workers: int, micro_batch: int) -> tuple[float, int]:
    """One rank's loader over ``epochs`` epochs (world size 1: every sample but the remainder): seconds, samples."""
    loader = build_loader(manifest, 0, 1, workers, 0, micro_batch)
    return _until_last(b["input_ids"].shape[0] for b in loader.batches(epochs * loader.batches_per_epoch))


def median_loader_rate(manifest: Path, epochs: int, workers: int, micro_batch: int, repeat: int) -> tuple[float, int]:
    """Samples/s of the loader over ``epochs`` epochs: the median of ``repeat`` rounds, and samples per round."""
    runs = [loader_epochs(manifest, epochs, workers, micro_batch) for _ in range(repeat)]
    return statistics.median(n / s for s, n in runs), runs[0][1]


def model_consumption(model: Any, manifest: Path, workers: int, micro_batch: int, warmup: int,
                      steps: int) -> dict[str, Any]:
    """Forward + backward of ``model`` on ``warmup + steps`` loader batches; figures of the timed ``steps``."""
    import torch

    from trainer.model.flops import mfu, training_flops
    from trainer.model.timing import timed_forward_backward
    from trainer.train import batch_shapes, model_inputs

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    cuda = device.type == "cuda"
    loader = build_loader(manifest, 0, 1, workers, 0, micro_batch)
    times, flops = [], []
    for index, batch in enumerate(loader.batches(warmup + steps)):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        seconds, out = timed_forward_backward(model, lambda: model_inputs(batch, device, dtype))
        log.info("model step %d%s: %.2f s, loss %.4f", index + 1, " (warm-up)" if index < warmup else "", seconds,
                 float(out.loss.detach()))
        if index >= warmup:
            times.append(seconds)
            flops.append(training_flops(model.config, *batch_shapes(batch), n_loss_tokens=out.n_loss_tokens).total)
    step = statistics.median(times)
    return {"model_step_s": step, "model_steps_s": times,
            "model_tokens_per_s": micro_batch * loader.seq_len / step,
            "mfu": mfu(statistics.median(flops), step) if cuda else None,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def against_model(args: argparse.Namespace) -> None:
    """Loader tokens/s against the forward + backward consumption of ``args.against_model``, stage by stage."""
    import torch

    from trainer.model import LongweaveModel, preset

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    started = time.perf_counter()
    with device:
        model = LongweaveModel(preset(args.against_model)).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    log.info("built %s on %s in %.1f s", args.against_model, device, time.perf_counter() - started)
    table = Table(title=f"streaming loader ({args.workers} workers) vs {args.against_model} forward + backward on "
                        f"{device.type}, micro-batch {args.micro_batch}")
    for column in ("stage", "loader samples", "loader tokens/s", "model step s", "model tokens/s", "loader / model",
                   "MFU", "peak GiB"):
        table.add_column(column, justify="right")
    for stage in args.stages.split(","):
        manifest = args.path / stage / MANIFEST_NAME
        source = ManifestSource(manifest)
        warm_page_cache([Path(s.path) for s in source.shards])
        rate, samples = median_loader_rate(manifest, -(-args.min_samples // source.total_samples), args.workers,
                                           args.micro_batch, args.repeat)
        result = {"stage": stage, "seq_len": source.seq_len, "micro_batch": args.micro_batch, "workers": args.workers,
                  "model": args.against_model, "device": device.type, "loader_samples": samples,
                  "loader_tokens_per_s": rate * source.seq_len}
        log.info("%s loader: %.2f samples/s, %.0f tokens/s", stage, rate, result["loader_tokens_per_s"])
        result.update(model_consumption(model, manifest, args.workers, args.micro_batch, args.warmup_steps,
                                        args.model_steps))
        result["loader_over_model"] = result["loader_tokens_per_s"] / result["model_tokens_per_s"]
        table.add_row(stage, f"{samples}", f"{result['loader_tokens_per_s']:,.0f}", f"{result['model_step_s']:.2f}",
                      f"{result['model_tokens_per_s']:,.0f}", f"{result['loader_over_model']:.1f}",
                      "-" if result["mfu"] is None else f"{result['mfu']:.1%}",
                      "-" if result["peak_memory_gib"] is None else f"{result['peak_memory_gib']:.1f}")
        print(json.dumps(result), flush=True)
    Console(width=200).print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a longweave pack output folder (holding <stage>/manifest.json)")
    parser.add_argument("--stages", default="8k,64k,256k,1m", help="comma-separated stage folders to read")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers on both sides")
    parser.add_argument("--micro-batch", type=int, default=1, help="loader micro-batch (samples per batch)")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds of each side per stage (median reported)")
    parser.add_argument("--min-samples", type=int, default=16, help="read whole epochs until at least this many")
    parser.add_argument("--against-model", default=None, metavar="PRESET",
                        help="compare the loader with this model preset's forward + backward instead of webdataset")
    parser.add_argument("--warmup-steps", type=int, default=1, help="--against-model: untimed model steps first")
    parser.add_argument("--model-steps", type=int, default=3, help="--against-model: timed model steps (median)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.against_model is not None:
        against_model(args)
        return
    special = load_tokenizer().special
    table = Table(title=f"streaming loader vs plain webdataset: {args.workers} workers, micro-batch "
                        f"{args.micro_batch}, median of {args.repeat}")
    for column in ("stage", "epochs", "side", "samples", "median s", "samples/s", "tokens/s", "loader / wds", "raw s"):
        table.add_column(column, justify="right")
    for stage in args.stages.split(","):
        manifest = args.path / stage / MANIFEST_NAME
        source = ManifestSource(manifest)
        warm_page_cache([Path(s.path) for s in source.shards])
        epochs = -(-args.min_samples // source.total_samples)
        readers = {"webdataset": lambda: webdataset_epochs(source, epochs, args.workers, special),
                "loader": lambda: loader_epochs(manifest, epochs, args.workers, args.micro_batch)}
        sides: dict[str, list[tuple[float, int]]] = {"webdataset": [], "loader": []}
        for round_ in range(args.repeat):
            for name in (("webdataset", "loader") if round_ % 2 == 0 else ("loader", "webdataset")):
                sides[name].append(readers[name]())
            log.info("%s round %d: webdataset %.2f s, loader %.2f s", stage, round_ + 1, sides["webdataset"][-1][0],
                     sides["loader"][-1][0])
        rates = {name: statistics.median(n / s for s, n in runs) for name, runs in sides.items()}
        for name, runs in sides.items():
            seconds, samples = statistics.median(s for s, _ in runs), runs[0][1]
            ratio = f"{rates['loader'] / rates['webdataset']:.2f}" if name == "loader" else ""
            table.add_row(stage, f"{epochs}", name, f"{samples}", f"{seconds:.2f}", f"{rates[name]:.2f}",
                          f"{rates[name] * source.seq_len:,.0f}", ratio, " ".join(f"{s:.2f}" for s, _ in runs))
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
