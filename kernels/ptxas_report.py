"""Registers, spills, shared memory and programs per multiprocessor of every KDA, short-convolution, AttnRes and MoE
SwiGLU kernel config on sm_90, without a GPU.

    python -m kernels.ptxas_report [--head-dim 128] [--heads 16] [--stages 3] [--chunk 64]

Triton compiles each autotune config for Hopper here and the `ptxas` it ships reports the machine code's registers
and spilled bytes (`-v`). A config that spills kilobytes per thread is a lead worth a device call; one that does not
is no promise of speed. Triton on this machine may differ from the device image's, so its code may differ too.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from kernels.attn_res import block, mix
from kernels.kda import chunk_bwd, chunk_fwd, chunk_intra
from kernels.kda.chunk import CHUNK_SIZES
from kernels.short_conv import conv
from kernels.tuning import config

swiglu = importlib.import_module("kernels.moe.swiglu")  # the package exports the function under the same name

HOPPER = GPUTarget("cuda", 90, 64)
# An H100/H200 multiprocessor: 64K registers (allocated per warp in units of 256), 64 warps, 32 resident programs,
# and 228 KB of shared memory, of which each program takes 1 KB more than it asks for.
SM_REGISTERS, SM_WARPS, SM_PROGRAMS, SM_SHARED, PROGRAM_RESERVED_SHARED = 65536, 64, 32, 233472, 1024
FLOAT32_ARGS = {"g", "A_log", "dt_bias", "gam", "dbeta", "h0", "ht", "dht", "dh0", "dg", "dw", "logits", "dots",
                "s_ptr", "ds_ptr", "lse", "dlse", "scratch", "dq", "sp", "rp", "drp"}
INT32_ARGS = {"chunks", "cu_seqlens", "chunk_offsets", "order"}
INT64_ARGS = {"pos"}
SCALAR_ARGS = {"scale": "fp32", "eps": "fp32", "T": "i32", "CHAINS": "i32", "C": "i32", "x_rows": "i32",
               "dx_rows": "i32", "M": "i32", "F_DIM": "i32", "acc": "i32"}
TUPLE_ARGS = {"srcs": "*bf16", "dsrcs": "*bf16", "rms": "*fp32", "drms": "*fp32"}  # N pointers each
# Integer arguments a launch of ``small`` finds divisible by 16 and that address memory: the short convolution's
# channels per group (1,024). Unmarked, its dy and da rows compile to 2-byte accesses that no launch runs, and
# Triton does not pipeline them.
DIVISIBLE_SCALARS = ("C",)


def signature(fn: JITFunction, constants: dict) -> dict[str, str | tuple[str, ...]]:
    """Argument types of a bf16 run (g float32), as the chunk_kda, short_conv_silu and attn_res_mix wrappers pass
    them."""
    def kind(name: str) -> str | tuple[str, ...]:
        if name in constants:
            return "constexpr"
        if name in TUPLE_ARGS:
            return (TUPLE_ARGS[name],) * constants["N"]
        if name in SCALAR_ARGS:
            return SCALAR_ARGS[name]
        if name in INT64_ARGS:
            return "*i64"
        return "*i32" if name in INT32_ARGS else "*fp32" if name in FLOAT32_ARGS else "*bf16"
    return {name: kind(name) for name in fn.arg_names}


def jit_function(kernel: triton.runtime.Autotuner | JITFunction) -> JITFunction:
    """The JIT function under an autotuner (or several)."""
    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


def compile_for_hopper(kernel: triton.runtime.Autotuner | JITFunction, constants: dict, config: triton.Config,
                       stages: int = 3, divisible: tuple[str, ...] = ()) -> Any:
    """The kernel compiled for sm_90 with the config's meta-parameters; ``divisible``: the arguments a launch would
    find divisible by 16 (Triton specialises on that: pointers 16-byte aligned, integers multiples of 16), each
    pointer of a tuple argument too."""
    fn = jit_function(kernel)
    constants = constants | config.kwargs
    cap = {"maxnreg": config.maxnreg} if getattr(config, "maxnreg", None) else {}
    attrs = {}
    for name in divisible:
        index = fn.arg_names.index(name)
        paths = [(index, j) for j in range(constants["N"])] if name in TUPLE_ARGS else [(index,)]
        attrs |= {path: [["tt.divisibility", 16]] for path in paths}
    return triton.compile(ASTSource(fn, signature(fn, constants), constants, attrs), target=HOPPER,
                          options=dict(num_warps=config.num_warps, num_stages=stages, **cap))


def pointer_args(fn: JITFunction, constants: dict) -> tuple[str, ...]:
    """The arguments that are pointers (tuples of them included) in a launch with these constants."""
    kinds = signature(fn, constants)
    return tuple(name for name, kind in kinds.items()
                 if (kind[0] if isinstance(kind, tuple) else kind).startswith("*"))


def launch_divisible(fn: JITFunction, constants: dict) -> tuple[str, ...]:
    """The arguments a launch of ``small`` finds divisible by 16: every pointer, and ``DIVISIBLE_SCALARS``."""
    return pointer_args(fn, constants) + tuple(n for n in DIVISIBLE_SCALARS if n in fn.arg_names)


def programs_per_sm(registers: int, warps: int, shared: int) -> int:
    """Programs of one kernel resident on a Hopper multiprocessor at once, by whichever of registers, warps and
    shared memory runs out first: how many chains of loads and dependent products a latency-bound kernel overlaps
    (the KDA and AttnRes kernels run one to three)."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(SM_REGISTERS // (per_warp * warps), SM_WARPS // warps, SM_PROGRAMS,
               SM_SHARED // (shared + PROGRAM_RESERVED_SHARED))


def report(kernel: triton.runtime.Autotuner | JITFunction, constants: dict, config: triton.Config, stages: int) -> str:
    """One line: the kernel, its config and what ptxas says of it, every pointer 16-byte aligned (as PyTorch's
    allocations are; Triton specialises on it at launch, and vectorises loads only then) and ``DIVISIBLE_SCALARS``
    multiples of 16; and its asynchronous copies (``cp.async``: the loads a pipelined loop puts in flight ahead)."""
    fn = jit_function(kernel)
    cap = {"maxnreg": config.maxnreg} if getattr(config, "maxnreg", None) else {}
    compiled = compile_for_hopper(kernel, constants, config, stages, launch_divisible(fn, constants | config.kwargs))
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", ptx, "-o", ptx + ".o"],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    warps = f"{config.num_warps}" + (f" maxnreg={cap['maxnreg']}" if cap else "")
    copies = len(re.findall(r"cp\.async\.c[ag]\.", compiled.asm["ptx"]))
    shared = compiled.metadata.shared
    resident = programs_per_sm(int(regs.group(1)), config.num_warps, shared)
    return (f"{fn.__name__:32} {str(config.kwargs):22} warps={warps}  registers={regs.group(1)}  "
            f"spilled stores/loads={spills.group(1)}/{spills.group(2)} B  shared={shared} B  "
            f"async copies={copies}  programs/SM={resident}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128, help="K = V")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--stages", type=int, default=3, help="num_stages (triton.Config's default is 3)")
    parser.add_argument("--chunk", type=int, default=64, choices=CHUNK_SIZES, help="the KDA kernels' chunk")
    args = parser.parse_args(argv)
    shape = dict(H=args.heads, K=args.head_dim, V=args.head_dim, BT=args.chunk)
    gate = dict(USE_GATE=False, HAS_BIAS=False, G_MIN=-5.0, PREC="tf32")
    kernels = [
        (chunk_intra.chunk_kda_fwd_intra_kernel, chunk_intra.INTRA_SPACE,
         shape | gate | dict(BC=16, SOLVE_PREC="tf32", GRAM="bf16")),
        (chunk_fwd.chunk_kda_fwd_h_kernel, chunk_fwd.STATE_PASS_SPACE,
         shape | dict(PREC="tf32", USE_H0=False, STORE_HT=False, SAVE_H=True)),
        (chunk_bwd.chunk_kda_bwd_dh_kernel, chunk_fwd.STATE_PASS_SPACE,
         shape | dict(PREC="tf32", USE_DHT=False, STORE_DH0=False)),
        (chunk_bwd.chunk_kda_bwd_dA_kernel, chunk_bwd.DA_SPACE,
         dict(H=args.heads, V=args.head_dim, BT=args.chunk, SLOT=args.head_dim // 32, PREC="tf32")),
        (chunk_bwd.chunk_kda_bwd_dqkg_kernel, chunk_bwd.DQKG_SPACE, shape | gate | dict(BC=16, GRAM="bf16")),
    ]
    configs = [(kernel, config(*entry), constants) for kernel, space, constants in kernels for entry in space
               if max(entry[0].values()) <= args.head_dim]
    # The short convolution of the KDA layer (width 4), whatever the head dim: without and with the head L2 norm (q
    # and k), whose tiles hold whole heads.
    for norm in (dict(NORM=False, HD=1), dict(NORM=True, HD=args.head_dim)):
        configs += [(kernel, config(*entry), constants)
                    for kernel, space, constants in [
                        (conv.short_conv_fwd_kernel, conv.FWD_SPACE, dict(W=4, X_ALIGN=8) | norm),
                        (conv.short_conv_bwd_da_kernel, conv.DA_SPACE, dict(W=4, WP=4, ROWS=conv.BWD_ROWS, X_ALIGN=8)
                         | norm)]
                    for entry in space if not norm["NORM"] or entry[0]["BC"] % args.head_dim == 0]
    configs += [(conv.short_conv_bwd_dx_kernel, config(*entry), dict(W=4, DX_ALIGN=8)) for entry in conv.FWD_SPACE]
    # The AttnRes mixture of ``small`` (d = 1024) over 9 sources, the most a sublayer mixes, with the norm; the
    # backward adding into the 8 finished blocks' gradients.
    mixture = dict(N=9, NP=16, D=1024, BD=1024, NORM=True)
    configs += [(kernel, config(*entry), constants)
                for kernel, space, constants in [(mix.attn_res_fwd_kernel, mix.FWD_SPACE, mixture),
                                                 (mix.attn_res_bwd_kernel, mix.BWD_SPACE,
                                                  mixture | dict(ROWS=mix.BWD_ROWS))]
                for entry in space]
    # The two-phase AttnRes of ``small``'s last block: 8 finished blocks, 5 sublayers; each sublayer's merge.
    parts = dict(N=8, NP=8, S=5, SP=8, D=1024, BD=1024)
    configs += [(kernel, config(*entry), constants)
                for kernel, space, constants in [(block.block_mix_fwd_kernel, block.BLOCK_FWD_SPACE, parts),
                                                 (block.block_mix_bwd_kernel, block.BLOCK_BWD_SPACE, parts),
                                                 (block.merge_fwd_kernel, block.MERGE_FWD_SPACE,
                                                  dict(D=1024, BD=1024, HAS_P=True)),
                                                 (block.merge_bwd_kernel, block.MERGE_BWD_SPACE,
                                                  dict(D=1024, BD=1024, HAS_P=True, ROWS=block.MERGE_ROWS))]
                for entry in space]
    # The experts' SwiGLU of ``small`` (d_expert = 224) with the gates as its row scale, at the blocks it launches.
    configs += [(kernel, config(swiglu._blocks(224), swiglu.WARPS), dict(SCALED=True))
                for kernel in (swiglu.swiglu_fwd_kernel, swiglu.swiglu_bwd_kernel)]
    for kernel, tuned, constants in configs:
        print(report(kernel, constants, tuned, args.stages), flush=True)

if __name__ == "__main__":
    main()
