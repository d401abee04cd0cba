"""``longweave pack``: the driver of the Beam packing job (thin: parse, resolve, build the graph, run, report).

Unknown flags go to Beam's ``PipelineOptions`` unchanged, so the same command runs on Dataflow, Flink or Spark with
``--runner``. Without ``--runner`` the job runs offline on the FnApiRunner (``--direct_running_mode=multi_processing
--direct_num_workers=N`` gives it N worker processes); plain DirectRunner would first try Prism, which downloads a
binary.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from rich.console import Console
from rich.table import Table

from pipeline.readers import FORMATS
from pipeline.shards import TMP_SUFFIX
from pipeline.transforms import PackGraph, fingerprint_inputs
from schemas.manifest import MANIFEST_NAME, ShardManifest
from schemas.stage import DEFAULT_STAGES, STAGE_ORDER, StageSpec, load_stage_config
from tokenization.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from vision.geometry import DEFAULT_POLICY

__all__ = ["register", "run_pack", "match_inputs"]
log = logging.getLogger(__name__)


def match_inputs(patterns: list[str], fmt: str) -> list[str]:
    """Expand globs with Beam's filesystems; an ``hf`` input is a folder and is taken as is."""
    if fmt == "hf":
        missing = [p for p in patterns if not Path(p).is_dir()]
        if missing:
            raise SystemExit(f"--input: hf datasets must be local folders; not found: {missing[0]}")
        return sorted(patterns)
    files = []
    for pattern, result in zip(patterns, FileSystems.match(patterns)):
        found = [m.path for m in result.metadata_list]
        if not found:
            raise SystemExit(f"--input: no file matches {pattern!r}")
        files.extend(found)
    return sorted(set(files))


def select_stages(names: str, config: Path | None) -> dict[str, StageSpec]:
    available = load_stage_config(config) if config else DEFAULT_STAGES
    chosen = [n.strip() for n in names.split(",") if n.strip()] if names else list(available)
    unknown = [n for n in chosen if n not in available]
    if unknown:
        raise SystemExit(f"--stages: unknown stage {unknown[0]!r}; known: {', '.join(available)}")
    return {n: available[n] for n in chosen}


def _remove_stale_temps(output: Path) -> None:
    """A killed run leaves ``.<name>.tmp`` files; they never carry a final name, but tidy them before a rerun."""
    for tmp in output.glob(f"*/.*{TMP_SUFFIX}"):
        tmp.unlink()


def _remove_unlisted_shards(output: Path, manifests: dict[str, ShardManifest]) -> None:
    """Shards an earlier run with another config left in a stage folder are not part of this run's output."""
    for name, manifest in manifests.items():
        listed = {s.path for s in manifest.shards}
        for shard in sorted((output / name).glob("*.tar")):
            if shard.name not in listed:
                log.warning("removing %s: not in this run's manifest", shard)
                shard.unlink()


def _metrics(result: beam.runners.runner.PipelineResult) -> dict[str, int]:
    counters = result.metrics().query().get("counters", [])
    out: dict[str, int] = {}
    for counter in counters:
        out[counter.key.metric.name] = out.get(counter.key.metric.name, 0) + int(counter.committed or counter.attempted or 0)
    return dict(sorted(out.items()))


def run_pack(args: argparse.Namespace, beam_args: list[str]) -> dict:
    """Run the job; returns the content of ``run.json``."""
    started = time.time()
    output = Path(args.output)
    stages = select_stages(args.stages, args.config)
    files = match_inputs(args.input, args.format)
    tokenizer = load_tokenizer(args.tokenizer)
    policy = DEFAULT_POLICY
    fingerprints = {"tokenizer": tokenizer.fingerprint(policy), "vision": policy.fingerprint(),
                    "input": fingerprint_inputs(files)}
    graph = PackGraph(files=tuple(files), fmt=args.format, output=str(output), stages=stages,
                      image_root=str(args.image_root) if args.image_root else None, tokenizer_path=str(tokenizer.path),
                      policy=policy, fingerprints=fingerprints, lossless_images=args.lossless_images)
    for name in [*stages, "dead_letters"]:
        (output / name).mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(output)
    options = PipelineOptions(beam_args)
    runner = None if options.view_as(StandardOptions).runner else FnApiRunner()
    console = Console(stderr=True)
    with console.status(f"packing {len(files)} input file(s) into {', '.join(stages)} under {output}"):
        pipeline = beam.Pipeline(runner=runner, options=options)
        graph.build(pipeline)
        result = pipeline.run()
        result.wait_until_finish()
    manifests = {n: ShardManifest.from_json((output / n / MANIFEST_NAME).read_text()) for n in stages}
    _remove_unlisted_shards(output, manifests)
    report = {
        "config": {"input": files, "format": args.format, "stages": {n: s.to_dict() for n, s in stages.items()},
                   "image_root": str(args.image_root) if args.image_root else None, "tokenizer": str(tokenizer.path),
                   "vision_policy": policy.to_dict(), "lossless_images": args.lossless_images,
                   "beam_args": beam_args, "runner": type(runner).__name__ if runner else options.view_as(StandardOptions).runner},
        "fingerprints": fingerprints,
        "counts": {n: {**dataclasses.asdict(m.documents), "samples": m.total_samples, "shards": len(m.shards),
                       "fill_ratio": m.packing["fill_ratio"]} for n, m in manifests.items()},
        "metrics": _metrics(result),
        "timings": {"wall_seconds": round(time.time() - started, 3)},
    }
    (output / "run.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report


def _print_report(report: dict) -> None:
    table = Table(title="longweave pack")
    for col in ("stage", "documents in", "packed", "dead-lettered", "not selected", "samples", "shards", "fill"):
        table.add_column(col, justify="right")
    for name in sorted(report["counts"], key=lambda n: STAGE_ORDER.index(n) if n in STAGE_ORDER else 99):
        c = report["counts"][name]
        table.add_row(name, f"{c['input']:,}", f"{c['packed']:,}", f"{c['dead_lettered']:,}", f"{c['not_selected']:,}",
                      f"{c['samples']:,}", f"{c['shards']:,}", f"{c['fill_ratio']:.2%}")
    Console().print(table)


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    _print_report(run_pack(args, extra))
    return 0


def add_pack_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", nargs="+", required=True, help="input files or globs (hf: dataset folders)")
    parser.add_argument("--format", required=True, choices=sorted(FORMATS), help="input format")
    parser.add_argument("--output", required=True, help="output folder")
    parser.add_argument("--stages", default="", help="comma-separated stages (default: all of the config)")
    parser.add_argument("--config", type=Path, default=None, help="YAML stage config (default: 8k,64k,256k,1m)")
    parser.add_argument("--image-root", type=Path, default=None, help="folder that image references resolve under")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER_PATH, help="tokenizer.json to use")
    parser.add_argument("--lossless-images", action="store_true", help="store lossless sources as PNG, not JPEG")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("pack", help="pack documents into length-bucketed WebDataset shards (Beam job)",
                                   description=__doc__)
    add_pack_arguments(parser)
    parser.set_defaults(handler=_run, accepts_extra=True)
