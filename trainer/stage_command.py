"""``longweave stage status|plan|advance --run DIR [--to STAGE] [--world-size N]``: drive a run's curriculum."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trainer.config import recompute_label
from trainer.curriculum import StageError, advance, next_stage, plan_stage
from trainer.run_dir import RunDir

__all__ = ["register"]


def _status(run: RunDir, args: argparse.Namespace) -> dict:
    config = run.load_config()
    current = run.current_stage(config)
    stage = config.stage(current)
    checkpoint = run.latest_checkpoint()
    state = run.trainer_state(checkpoint)["trainer"] if checkpoint else None
    stage_tokens = state["stage_tokens"] if state and state["stage"] == current else 0
    return {"run": str(run.root), "stage": current, "stage_tokens": stage_tokens, "stage_budget": stage.token_budget,
            "step": state["step"] if state else 0, "tokens": state["tokens"] if state else 0,
            "last_checkpoint": str(checkpoint) if checkpoint else None}


def _plan(run: RunDir, args: argparse.Namespace) -> dict:
    config = run.load_config()
    current = run.current_stage(config)
    plans = [plan_stage(config, s, args.world_size).to_dict() for s in config.stages]
    try:
        upcoming = next_stage(config, current, args.to).name
    except StageError:
        upcoming = None
    return {"current": current, "next": upcoming, "stages": plans}


def _advance(run: RunDir, args: argparse.Namespace) -> dict:
    return advance(run, run.load_config(), args.world_size, args.to)


def _print(action: str, result: dict) -> None:
    console = Console(width=None if sys.stdout.isatty() else 160)   # logs and pipes: no truncated numbers at 80
    if action == "plan":
        table = Table(title=f"curriculum (current {result['current']}, next {result['next']})")
        for col in ("stage", "seq_len", "micro_batch", "grad_accum", "world_size", "tokens/step", "steps", "budget",
                    "recompute", "vision recompute"):
            table.add_column(col, justify="right")
        for p in result["stages"]:
            table.add_row(p["stage"], f"{p['seq_len']:,}", str(p["micro_batch"]), str(p["grad_accum"]),
                          str(p["world_size"]), f"{p['tokens_per_step']:,}", f"{p['steps']:,}", f"{p['token_budget']:,}",
                          recompute_label(p["activation_checkpointing"]), recompute_label(p["vision_checkpointing"]))
        console.print(table)
    else:
        table = Table(title=f"stage {action}")
        table.add_column("field")
        table.add_column("value")
        for key, value in result.items():
            table.add_row(key, json.dumps(value) if isinstance(value, (dict, list)) else str(value))
        console.print(table)


_ACTIONS = {"status": _status, "plan": _plan, "advance": _advance}


def _run(args: argparse.Namespace, _extra: list[str]) -> int:
    run = RunDir(args.run)
    try:
        result = _ACTIONS[args.action](run, args)
    except (StageError, FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"longweave stage {args.action}: {exc}") from None
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        _print(args.action, result)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("stage", help="show, plan or advance a run's curriculum stage")
    parser.add_argument("action", choices=sorted(_ACTIONS))
    parser.add_argument("--run", type=Path, required=True, help="run folder of `longweave train`")
    parser.add_argument("--to", default=None, help="advance to this stage instead of the next one")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel size the plan is for")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=_run)
