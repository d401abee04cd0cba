#!/bin/bash
# Issue 9's device call (devrun/README.md, "Next trainer calls"): the AttnRes mixture's bench (BENCH=0 skips it;
# an untracked kernels/attn_res/mix_prev.py, if present, is benched too, as the A/B's other side), then the 8k stage
# through DeepSpeed with its config's profiled step, then the GPU tests of the kernels that changed (TESTS, run with
# whatever time the call has left). Run after the wheel-install prefix with a call limit of 600 s, carry [".whl",
# ".devdata"]. The run folder stays in /tmp (a call returns at most 8 files); its metrics, profile summary and kernel
# CSV are copied to $OUT as they appear, so a call cut off by its limit still returns the steps it finished.
# STAGE_CONFIG (default devrun/gpu_small_8k_ac2.yaml) and STAGE_SECONDS (default 390) pick the stage run.
set -u
export PYTHONUNBUFFERED=1
if [ "${BENCH:-1}" = 1 ]; then
  timeout -k 5 100 python3 -m kernels.attn_res.bench --impls longweave > "$OUT/attn_res_bench.txt" 2>&1
  if [ -f kernels/attn_res/mix_prev.py ]; then
    cp kernels/attn_res/mix.py /tmp/mix_now.py && cp kernels/attn_res/mix_prev.py kernels/attn_res/mix.py
    timeout -k 5 100 python3 -m kernels.attn_res.bench --impls longweave > "$OUT/attn_res_bench_prev.txt" 2>&1
    cp /tmp/mix_now.py kernels/attn_res/mix.py
  fi
  grep -v Warn "$OUT"/attn_res_bench*.txt | grep -i "longweave\|error"
fi
# The copier's output goes nowhere: a background job holding the call's stdout keeps a `| tee` open to the limit
# (2026-12-04: 140 s of device time lost that way).
(while sleep 5; do cp /tmp/run/metrics.jsonl /tmp/run/profile-step* "$OUT/" 2>/dev/null; done) >/dev/null 2>&1 &
copier=$!
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 ${STAGE_SECONDS:-390} \
  python3 -m trainer.train --run /tmp/run --config "${STAGE_CONFIG:-devrun/gpu_small_8k_ac2.yaml}" > "$OUT/train.log" 2>&1
kill $copier
cp /tmp/run/metrics.jsonl /tmp/run/profile-step* "$OUT/" 2>/dev/null
grep "INFO.*step [0-9]" "$OUT/train.log" | tail -4
grep -i -m5 "error\|out of memory" "$OUT/train.log"
sed -n '/GPU time per step by kind/,$p' "$OUT"/profile-step*.txt 2>/dev/null
if [ -n "${TESTS:-}" ]; then
  timeout -k 5 "${TEST_SECONDS:-60}" python3 -m pytest -n 4 $TESTS -p no:cacheprovider -q -rf > "$OUT/gpu_tests.txt" 2>&1
  tail -4 "$OUT/gpu_tests.txt"
fi
