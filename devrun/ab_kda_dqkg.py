"""A/B of the KDA dq/dk/dg kernel in one process: the tree's ``chunk_kda_bwd_dqkg_kernel`` against the one in a
baseline copy of ``kernels/kda/chunk_bwd.py``, alternately, under the profiler at 8 x 8K's shape (the 34-document
65,536-token batch of ``kernels.kda.bench``, H = 8). Both run one config (the H200 and H100 pick by default), every
other KDA kernel its first config, so nothing is tuned and a cold machine needs about 35 s:

    git show COMMIT:kernels/kda/chunk_bwd.py > devrun/ab_baseline_chunk_bwd.py   # untracked, travels to the device
    PYTHONPATH=$PWD python3 devrun/ab_kda_dqkg.py devrun/ab_baseline_chunk_bwd.py | grep "####\\|dqkg_kernel"
"""
from __future__ import annotations

import argparse
import importlib.util

from triton.runtime.autotuner import Autotuner

import kernels.kda.bench as bench
from kernels.kda import chunk_bwd, chunk_fwd, chunk_intra, l2norm

KERNEL = "chunk_kda_bwd_dqkg_kernel"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline", help="a copy of kernels/kda/chunk_bwd.py inside the repository")
    parser.add_argument("--bv", type=int, default=64)
    parser.add_argument("--bk", type=int, default=32)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("baseline_chunk_bwd", args.baseline)
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)
    bench.H = 8
    for module in (chunk_bwd, chunk_fwd, chunk_intra, l2norm, baseline):
        for name, tuner in vars(module).items():
            if isinstance(tuner, Autotuner):
                keep = [c for c in tuner.configs if name != KERNEL
                        or (c.kwargs == {"BV": args.bv, "BK": args.bk} and c.num_warps == args.warps)]
                if not keep:
                    raise SystemExit(f"{args.baseline if module is baseline else 'the tree'}: no config "
                                     f"BV {args.bv} / BK {args.bk} at {args.warps} warps in {KERNEL}'s space")
                tuner.configs, tuner.early_config_prune = keep[:1], None
    kernels = {"tree": getattr(chunk_bwd, KERNEL), "baseline": getattr(baseline, KERNEL)}
    for _ in range(args.rounds):
        for side, kernel in kernels.items():
            setattr(chunk_bwd, KERNEL, kernel)   # chunk_kda_bwd launches the module's global
            print(f"#### {side}", flush=True)
            bench.main(["--profile", "65536", "--varlen", "--impls", "longweave-gate"])
    setattr(chunk_bwd, KERNEL, kernels["tree"])


if __name__ == "__main__":
    main()
