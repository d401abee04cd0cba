"""A/B of the KDA kernels in one process: the tree's against copies of ``kernels/kda/chunk_bwd.py`` or
``chunk_intra.py`` (each copy's whole backward or intra-chunk forward swapped in, so a copy may change what its
kernels exchange, e.g. the Gram gradients' dtype),
alternately, under the profiler at 8 x 8K's shape (the 34-document 65,536-token batch of ``kernels.kda.bench``,
H = 8). The dq/dk/dg kernel runs one config (the H200 and H100 pick by default), the forward intra kernel the one
``--intra-bk`` names (the picks: BK 64, BV 64, 4 warps) or its first, every other KDA kernel its first config, so
nothing is tuned and a cold machine needs about 35 s. Before timing, each side's bf16 gradients are
compared with the float32 chunked reference (``test_gpu_bf16_matches_fp32_reference``'s varlen case: the test
allows 1e-2):

    git show COMMIT:kernels/kda/chunk_bwd.py > devrun/ab_baseline_chunk_bwd.py   # untracked, travels to the device
    PYTHONPATH=$PWD python3 devrun/ab_kda_dqkg.py devrun/ab_baseline_chunk_bwd.py | grep "####\\|dqkg_kernel"
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
from triton.runtime.autotuner import Autotuner

import kernels.kda.bench as bench
from kernels.kda import chunk, chunk_bwd, chunk_fwd, chunk_intra, l2norm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))   # test_kda's helpers, once
KERNEL, INTRA = "chunk_kda_bwd_dqkg_kernel", "chunk_kda_fwd_intra_kernel"
SWAPPED = ("chunk_kda_bwd", "chunk_kda_fwd_intra")   # what kernels.kda.chunk calls: a copy replaces what it defines


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"ab_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pin_configs(modules: list[ModuleType], pins: dict[str, tuple[dict[str, int], int]]) -> None:
    """One config a kernel: ``pins``' (meta-parameters, warps) for the kernels it names, the first for the rest."""
    for module in modules:
        for name, tuner in vars(module).items():
            if isinstance(tuner, Autotuner):
                kwargs, warps = pins.get(name, (None, None))
                keep = [c for c in tuner.configs if kwargs is None or (c.kwargs == kwargs and c.num_warps == warps)]
                if not keep:
                    raise SystemExit(f"{module.__name__}: no config {kwargs} at {warps} warps in {name}")
                tuner.configs, tuner.early_config_prune = keep[:1], None


def _swap(tree: dict, module: ModuleType) -> None:
    """kernels.kda.chunk calls the copy's functions (by their module globals) where it defines them, else the tree's."""
    for name, function in tree.items():
        setattr(chunk, name, getattr(module, name, function))


def _errors() -> dict[str, float]:
    from test_kda import _gpu_reference, make_inputs, rel_err, run

    case = make_inputs(1, 8192, 4, 128, 128, True, n_docs=5, device="cuda", dtype=torch.bfloat16)
    o_ref, ht_ref, g_ref, grad_out = _gpu_reference(case)
    o, ht, grads, _ = run(chunk.chunk_kda, case["inputs"], case["cu_seqlens"], grad_out)
    return {"o": rel_err(o, o_ref), **{f"d{n}": rel_err(grads[n], g_ref[n]) for n in grads}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("others", nargs="+",
                        help="copies of kernels/kda/chunk_bwd.py or chunk_intra.py inside the repository")
    parser.add_argument("--bv", type=int, default=64)
    parser.add_argument("--bk", type=int, default=32)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--intra-bk", type=int, help="the forward intra kernel's BK (default: its first config)")
    parser.add_argument("--intra-bv", type=int, default=64)
    parser.add_argument("--intra-warps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sides = {"tree": chunk_bwd, **{path: _load(path) for path in args.others}}
    tree = {name: getattr(chunk, name) for name in SWAPPED}
    pins = {KERNEL: ({"BV": args.bv, "BK": args.bk}, args.warps)}
    if args.intra_bk:
        pins[INTRA] = ({"BK": args.intra_bk, "BV": args.intra_bv}, args.intra_warps)
    _pin_configs([chunk_bwd, chunk_fwd, chunk_intra, l2norm, *sides.values()], pins)
    for side, module in sides.items():
        _swap(tree, module)
        print(f"#### {side} errors against float32: "
              + ", ".join(f"{n} {e:.2e}" for n, e in _errors().items()), flush=True)
    for _ in range(args.rounds):
        for side, module in sides.items():
            _swap(tree, module)
            print(f"#### {side}", flush=True)
            bench.main(["--profile", "65536", "--varlen", "--impls", "longweave-gate", "--heads", "8"])
    _swap(tree, chunk_bwd)


if __name__ == "__main__":
    main()
