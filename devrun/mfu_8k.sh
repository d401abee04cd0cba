#!/bin/bash
# Issue 9's first device call after the 2026-12-04 session (devrun/README.md, "Next trainer calls"): the GPU tests of
# the AttnRes kernels and the attention backends, their benches, then the 8k stage through DeepSpeed with the step-3
# profile, on varlen attention unless a GPU test failed. About 9 minutes. Run after the wheel-install prefix, carry
# [".whl", ".devdata"]; everything lands in $OUT (at most 8 files come back: the run folder stays in /tmp).
set -u
export PYTHONUNBUFFERED=1
timeout -k 5 120 python3 -m pytest -n 4 -m gpu tests/kernels/test_attn_res.py tests/vision/test_attention_backends.py \
  -p no:cacheprovider -q -rf > "$OUT/gpu_tests.txt" 2>&1
tail -6 "$OUT/gpu_tests.txt"
timeout -k 5 60 python3 -m kernels.attn_res.bench --json "$OUT/bench.jsonl" > "$OUT/benches.txt" 2>&1
timeout -k 5 60 python3 -m vision.attention_bench --json "$OUT/bench.jsonl" >> "$OUT/benches.txt" 2>&1
timeout -k 5 40 python3 -m vision.attention_bench --bidirectional --heads 8 --head-dim 64 --sample 392 \
  --docs-per-sample 1 --json "$OUT/bench.jsonl" >> "$OUT/benches.txt" 2>&1
grep -v Warn "$OUT/benches.txt" | tail -24
backend=varlen
grep -q "failed\|error" "$OUT/gpu_tests.txt" && backend=flex
echo "attention backend for the stage: $backend"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True LONGWEAVE_ATTENTION=$backend timeout -k 10 270 \
  python3 -m trainer.train --run /tmp/run --config devrun/gpu_small_8k_ac10.yaml > "$OUT/train.log" 2>&1
cp /tmp/run/metrics.jsonl /tmp/run/profile-step3.txt "$OUT/"
grep "INFO.*step [0-9]" "$OUT/train.log" | tail -4
grep -i error "$OUT/train.log" | tail -5
tail -14 "$OUT/profile-step3.txt"
