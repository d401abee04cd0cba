#!/bin/bash
# Issue 9's first device call after the 2026-12-04 session (devrun/README.md, "Next trainer calls"): the GPU tests of
# the AttnRes kernels (the backward now tuned) and the attention backends, the AttnRes bench, then the 8k stage through
# DeepSpeed with the step-3 profile (step 1 alone took 195 s of tuning and compiles). About 8 minutes. Run after the
# wheel-install prefix, carry [".whl", ".devdata"]; everything lands in $OUT (at most 8 files come back: the run folder stays in /tmp).
set -u
export PYTHONUNBUFFERED=1
# Every AttnRes test on the GPU (the sink test tunes the backward afresh, its tuning runs adding into the sinks).
timeout -k 5 120 python3 -m pytest -n 4 tests/kernels/test_attn_res.py tests/vision/test_attention_backends.py \
  -p no:cacheprovider -q -rf > "$OUT/gpu_tests.txt" 2>&1
tail -6 "$OUT/gpu_tests.txt"
timeout -k 5 60 python3 -m kernels.attn_res.bench --json "$OUT/bench.jsonl" > "$OUT/benches.txt" 2>&1
grep -v Warn "$OUT/benches.txt" | tail -10
# flex: varlen was 0.73x its speed in the decoder's case and 0.80x in the vision tower's (BENCHMARKS.md).
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 330 \
  python3 -m trainer.train --run /tmp/run --config devrun/gpu_small_8k_ac10.yaml > "$OUT/train.log" 2>&1
cp /tmp/run/metrics.jsonl /tmp/run/profile-step3.txt "$OUT/"
grep "INFO.*step [0-9]" "$OUT/train.log" | tail -4
grep -i error "$OUT/train.log" | tail -5
tail -14 "$OUT/profile-step3.txt"
