"""Where a forward + backward turns non-finite: one loader batch of a stage through the model, with a forward hook on
every module and a check of every parameter's gradient.

    python -m trainer.model.finite_check PACK_OUTPUT --stage 1m [--preset small] [--micro-batch 1]

When DeepSpeed skips a step ("OVERFLOW! ... Gradients are non-finite") the trainer only knows the global norm is
inf; this runs the same batch without the engine (bf16 on CUDA, activation checkpointing on, so a 1M-token batch
fits) and names the modules whose outputs, in forward order, first hold inf or NaN, and the parameters whose
gradients do. The backward runs from the top layer down, so the highest layer with non-finite gradients is where
they start.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError

from trainer.model.multimodal import LongweaveModel


@dataclasses.dataclass
class FiniteReport:
    """Modules whose output was non-finite (forward order, each once), the loss, for each parameter with a
    non-finite gradient how many of its entries are, and the backward's error if it could not finish (a recompute
    that routes NaN tokens differently from the forward breaks activation checkpointing's bookkeeping)."""

    outputs: list[str]
    loss: float
    gradients: dict[str, int]
    backward_error: str | None = None

    def lines(self, limit: int = 20) -> list[str]:
        out = [f"loss {self.loss:.4f}",
               f"{len(self.outputs)} modules with non-finite outputs" + (", first:" if self.outputs else "")]
        out += [f"  {name}" for name in self.outputs[:limit]]
        out.append(f"{len(self.gradients)} parameters with non-finite gradients" + (":" if self.gradients else ""))
        out += [f"  {name}: {count:,}" for name, count in list(self.gradients.items())[:limit]]
        if self.backward_error:
            out.append(f"backward stopped: {self.backward_error}")
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _tensors(getattr(value, f.name))]
    return []


def finite_check(model: LongweaveModel, inputs: Mapping[str, Any]) -> FiniteReport:
    """One forward + backward of ``model(**inputs)`` with every module's output checked (the recompute of a
    checkpointed layer is checked too; a module is listed once)."""
    bad: dict[str, None] = {}

    def hook(name: str):
        def check(module: nn.Module, args: Any, output: Any) -> None:
            if name not in bad and any(t.is_floating_point() and not bool(torch.isfinite(t).all())
                                       for t in _tensors(output)):
                bad[name] = None
        return check

    handles = [m.register_forward_hook(hook(name or "model")) for name, m in model.named_modules()]
    try:
        model.zero_grad(set_to_none=True)
        out = model(**inputs)
        error = None
        try:
            out.loss.backward()
        except CheckpointError as e:
            error = str(e).splitlines()[0]
    finally:
        for h in handles:
            h.remove()
    counts = {name: int((~torch.isfinite(p.grad)).sum()) for name, p in model.named_parameters() if p.grad is not None}
    gradients = {name: count for name, count in counts.items() if count}
    return FiniteReport(list(bad), float(out.loss.detach()), gradients, error)


def main(argv: list[str] | None = None) -> None:
    from pathlib import Path

    from schemas.manifest import MANIFEST_NAME
    from trainer.data.loader import build_loader
    from trainer.model import preset
    from trainer.train import model_inputs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="pack output folder (one sub-folder per stage)")
    parser.add_argument("--stage", required=True)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--micro-batch", type=int, default=1)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with device:
        model = LongweaveModel(dataclasses.replace(preset(args.preset), checkpoint_layers=True)).to(dtype)
    loader = build_loader(args.path / args.stage / MANIFEST_NAME, 0, 1, 1, 0, args.micro_batch)
    batch = next(iter(loader.batches(1)))
    report = finite_check(model, model_inputs(batch, device, dtype))
    print(f"{args.preset} on {args.stage} ({', '.join(batch['sample_keys'])}):")
    print("\n".join(report.lines()))
    if device.type == "cuda":
        print(f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
