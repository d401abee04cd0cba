#!/bin/bash
# Nsight Compute's counters for the KDA forward intra and dq/dk/dg kernels at the 8k stage's shape (65,536 tokens,
# 34 documents, H = 8; one config each, the H200/H100 picks: devrun/ab_kda_dqkg.py pins them), as text in
# $OUT/kda_ncu.txt: what bounds them (issue stalls, occupancy, memory throughput) before changing either. The first
# launches of each are the error checks' small shape (two sides); --launch-skip passes over them, and six
# launches hold each kernel once at least, whatever the bench's warm-up runs first.
set -u
PYTHONPATH=$PWD timeout -k 5 "${NCU_SECONDS:-200}" ncu --clock-control none -k "regex:fwd_intra|dqkg" \
  --launch-skip 4 --launch-count 6 --set full --page details --print-units base \
  python3 devrun/ab_kda_dqkg.py kernels/kda/chunk_bwd.py --rounds 1 --intra-bk 64 --intra-bv 64 \
  > "$OUT/kda_ncu.txt" 2>&1
echo "ncu exit $?"; grep -E "^  [a-z_]+_kernel|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|\
Memory Throughput|Compute \(SM\) Throughput|Warp Cycles Per Issued|Stall" "$OUT/kda_ncu.txt" | head -60
