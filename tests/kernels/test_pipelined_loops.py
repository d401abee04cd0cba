"""The loops whose depth is tuned (``STAGES``: the rows of the AttnRes mixture's kernels and of the short
convolution's, the chunks of the KDA state passes) are software-pipelined on Hopper when it is above one: their
loads become asynchronous copies into shared memory, issued ahead of the rows being computed. ``tl.range(...,
num_stages=)`` only asks for it; whether Triton does it depends on each load (vector width, what it feeds), so a
Triton upgrade or an edit of a load could quietly lose it. Their results in every config are checked against the
references in ``test_attn_res.py``, ``test_short_conv.py`` and ``test_kda.py``."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CODE = """
import re
from kernels.attn_res import mix
from kernels.kda import chunk_bwd, chunk_fwd
from kernels.ptxas_report import compile_for_hopper, jit_function, launch_divisible
from kernels.short_conv import conv
from kernels.tuning import config

blocks = dict(W=4, BT=8, BC=256, ROWS=64)
mixture = dict(N=5, NP=8, D=1024, BD=1024, NORM=True, BT=1)
state = dict(H=8, K=128, V=128, BT=64, BV=32, PREC="tf32")
cases = [(mix.attn_res_fwd_kernel, mixture | dict(ROWS=16), 4),
         (mix.attn_res_bwd_kernel, mixture | dict(ROWS=mix.BWD_ROWS), 4),
         (conv.short_conv_bwd_da_kernel, dict(W=4, WP=4, ROWS=conv.BWD_ROWS, BT=8, BC=128, X_ALIGN=8, NORM=False,
                                               HD=1), 4),
         (conv.short_conv_fwd_kernel, blocks | dict(X_ALIGN=8, NORM=True, HD=128), 4),
         (conv.short_conv_bwd_dx_kernel, blocks | dict(DX_ALIGN=8), 4),
         (chunk_fwd.chunk_kda_fwd_h_kernel, state | dict(USE_H0=False, STORE_HT=False, SAVE_H=True), 4),
         (chunk_bwd.chunk_kda_bwd_dh_kernel, state | dict(USE_DHT=False, STORE_DH0=False), 4)]
for kernel, constants, warps in cases:
    fn = jit_function(kernel)
    counts = []
    for stages in (1, 2):
        staged = constants | {"STAGES": stages}
        ptx = compile_for_hopper(kernel, staged, config({}, warps), divisible=launch_divisible(fn, staged)).asm["ptx"]
        counts += [len(re.findall(r"cp[.]async[.]c[ag][.]", ptx)), len(re.findall(r"ld[.]global", ptx))]
    print(fn.__name__, *counts)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine times the kernels instead")
def test_row_loops_with_two_stages_load_through_asynchronous_copies() -> None:
    """Compiled for sm_90 in a process of its own (the compiler, not the interpreter): one stage loads every row's
    (chunk's) tiles with plain loads and no copy; two stages turn the loads of the loop body into ``cp.async``
    copies, leaving the few plain loads of weights (the pseudo-query and norm weight, the convolution's taps) and of
    a document's bounds."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300,
                         check=True).stdout
    rows = {name: tuple(map(int, counts)) for name, *counts in map(str.split, out.splitlines())}
    assert set(rows) == {"attn_res_fwd_kernel", "attn_res_bwd_kernel", "short_conv_bwd_da_kernel",
                         "short_conv_fwd_kernel", "short_conv_bwd_dx_kernel", "chunk_kda_fwd_h_kernel",
                         "chunk_kda_bwd_dh_kernel"}, out
    for name, (copies_1, loads_1, copies_2, loads_2) in rows.items():
        assert copies_1 == 0 and loads_1 > 4, (name, out)
        assert copies_2 >= 8 and loads_2 <= loads_1 // 2, (name, out)
