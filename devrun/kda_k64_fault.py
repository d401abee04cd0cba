"""Which KDA kernel config faults with bf16 Gram products at K = 64 (issue 9, 2026-12-07): on an H100 under Triton
3.6, ``test_gpu_bf16_matches_fp32_reference[B2-T2000-H2-K64]`` hit an illegal memory access while every config
passes the interpreter's bounds check, so ``gram_precision`` keeps tf32 Gram products at K != 128. This forces bf16
at any K and runs that test's case once per (kernel, config), each in its own process (a fault kills it), the other
kernels at their first config; then once with every config tuned:

    PYTHONPATH=$PWD timeout 300 python3 devrun/kda_k64_fault.py | tee $OUT/k64.txt
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parents[1] / "tests" / "kernels")


def survey() -> None:
    sys.path.insert(0, TESTS)
    import test_kda

    runs = [(kernel, i, entry) for kernel, (_, space) in test_kda.tuning_spaces().items()
            for i, entry in enumerate(space) if max(entry[0].values()) <= 64] + [("every-config", 0, None)]
    for kernel, i, entry in runs:
        r = subprocess.run([sys.executable, __file__, kernel, str(i)], capture_output=True, text=True, timeout=120)
        last = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
        print(kernel, entry, "rc", r.returncode, last[0][:200], flush=True)


def one(kernel: str, index: int) -> None:
    import torch

    sys.path.insert(0, TESTS)
    import test_kda
    from kernels.kda import chunk_bwd, chunk_intra
    from kernels.tuning import config

    def bf16_everywhere(dtype: torch.dtype, prec: str, K: int) -> str:  # noqa: ARG001 - gram_precision's signature
        return "bf16" if dtype == torch.bfloat16 else prec

    chunk_intra.gram_precision = chunk_bwd.gram_precision = bf16_everywhere
    for name, (tuned, space) in test_kda.tuning_spaces().items():
        if kernel != "every-config":
            tuned.configs, tuned.early_config_prune = [config(*(space[index] if name == kernel else space[0]))], None
    case = test_kda.make_inputs(2, 2000, 2, 64, 64, True, device="cuda", dtype=torch.bfloat16)
    o_ref, _, g_ref, grad_out = test_kda._gpu_reference(case)
    o, _, grads, _ = test_kda.run(test_kda.chunk_kda, case["inputs"], case["cu_seqlens"], grad_out)
    torch.cuda.synchronize()
    errors = {"o": test_kda.rel_err(o, o_ref)} | {f"d{n}": test_kda.rel_err(grads[n], g_ref[n]) for n in grads}
    print("ok " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))


if __name__ == "__main__":
    survey() if len(sys.argv) == 1 else one(sys.argv[1], int(sys.argv[2]))
