#!/bin/bash
# Issue 9's device call (devrun/README.md, "Next trainer calls"): every test of the AttnRes kernels (the backward
# tuned, its tuning runs restoring the sums they add into), the MoE and short-convolution kernels (the gates on the
# activations, the regathered expert input, the KDA layer's freed q/k) and the attention backends, then the 8k stage
# through DeepSpeed with its config's profiled step. About 9 minutes: on 2026-12-04 the AttnRes and attention tests
# passed 20 in their first 90 s and were cut there, step 1 took 279 s of tuning and compiles, step 2 13.2 s, and
# step 3 (profiled) ran past 330 s. Run after the wheel-install prefix with a call limit of 600 s, carry [".whl",
# ".devdata"]. The run folder stays in /tmp (a call returns at most 8 files); its metrics, profile summary and kernel
# CSV are copied to $OUT as they appear, so a call cut off by its limit still returns the steps it finished.
# STAGE_CONFIG (default devrun/gpu_small_8k_ac10.yaml) and STAGE_SECONDS (default 390) pick the stage run.
set -u
export PYTHONUNBUFFERED=1
timeout -k 5 150 python3 -m pytest -n 4 tests/kernels/test_attn_res.py tests/kernels/test_moe.py \
  tests/kernels/test_short_conv.py tests/vision/test_attention_backends.py \
  -p no:cacheprovider -q -rf > "$OUT/gpu_tests.txt" 2>&1
tail -4 "$OUT/gpu_tests.txt"
# The copier's output goes nowhere: a background job holding the call's stdout keeps a `| tee` open to the limit
# (2026-12-04: 140 s of device time lost that way).
(while sleep 5; do cp /tmp/run/metrics.jsonl /tmp/run/profile-step* "$OUT/" 2>/dev/null; done) >/dev/null 2>&1 &
copier=$!
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 ${STAGE_SECONDS:-390} \
  python3 -m trainer.train --run /tmp/run --config "${STAGE_CONFIG:-devrun/gpu_small_8k_ac10.yaml}" > "$OUT/train.log" 2>&1
kill $copier
cp /tmp/run/metrics.jsonl /tmp/run/profile-step* "$OUT/" 2>/dev/null
grep "INFO.*step [0-9]" "$OUT/train.log" | tail -4
grep -i -m5 error "$OUT/train.log"
sed -n '/GPU time per step by kind/,$p' "$OUT"/profile-step*.txt 2>/dev/null
