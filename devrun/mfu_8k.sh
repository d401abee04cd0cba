#!/bin/bash
# Issue 9's device call (devrun/README.md, "Next trainer calls"): first the GPU tests given in TESTS within
# TEST_SECONDS (verbose, so a run cut by its limit still names each test it finished; a cut stage returns its steps),
# then the AttnRes mixture's bench (BENCH=0 skips it; BENCH_ARGS adds to its arguments), also for each untracked
# variant kernels/attn_res/mix_*.py put in mix.py's place in turn (an A/B: the tree's kernel first), then the 8k stage
# through DeepSpeed with its config's profiled step (STAGE=0 skips it). Run after the wheel-install prefix with a call
# limit of 600 s, carry [".whl", ".devdata/shards"] (and ".cache.txz" when it exists, see below). The run folder stays in
# /tmp (a call returns at most 8 files); its metrics, profile summary and kernel CSV are copied to $OUT as they
# appear, so a call cut off by its limit still returns the steps it finished. STAGE_CONFIG (one or more) and
# STAGE_SECONDS (default 390, each) pick the stage runs; the default config is devrun/gpu_small_8k_h200.yaml (nothing
# recomputed, 105.9 GiB peak on the H200), or devrun/gpu_small_8k_h100.yaml (6 layers and 9 vision blocks recomputed)
# on a GPU of under 100 GB.
set -u
export PYTHONUNBUFFERED=1
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
default_config=devrun/gpu_small_8k_h200.yaml
[ "${gpu_mib:-0}" -gt 0 ] && [ "${gpu_mib}" -lt 100000 ] && default_config=devrun/gpu_small_8k_h100.yaml
echo "GPU memory ${gpu_mib:-unknown} MiB: stage config ${STAGE_CONFIG:-$default_config}"
# Triton's and Inductor's caches (autotuning results included) from an earlier call, when carried as .cache.txz: the
# stage's first step then takes about 20 s instead of 143-230 s. The call leaves the updated caches xz-compressed
# (6.5 MB on 2026-12-06; a larger one was 23 MB against 49 as a .tgz), so .whl, .devdata and the cache fit the 64 MiB
# carry, in $OUT/cache.txz.part-* (a call returns no file over about 16 MB): join them as .cache.txz at the
# repository root (`cat cache.txz.part-* > .cache.txz`) and carry it.
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor
[ -f .cache.txz ] && tar xJf .cache.txz
# The cache's tuning results also come back as this GPU's picks merged into the committed table: copy
# $OUT/tuning_picks.json over kernels/tuning_picks.json and commit it (a fresh machine then tunes nothing it lists).
pack_cache() {
  tar cf - .cache 2>/dev/null | xz -T0 -6 | split -b 15m - "$OUT/cache.txz.part-"
  cp kernels/tuning_picks.json "$OUT/" 2>/dev/null
  python3 -m kernels.tuning_picks --cache .cache/triton --output "$OUT/tuning_picks.json" 2>&1 | tail -1
}
trap pack_cache EXIT
if [ -n "${TESTS:-}" ]; then
  timeout -k 5 "${TEST_SECONDS:-60}" python3 -m pytest -n 4 $TESTS -p no:cacheprovider -v -rf > "$OUT/gpu_tests.txt" 2>&1
  tail -4 "$OUT/gpu_tests.txt"
fi
if [ "${BENCH:-1}" = 1 ]; then
  bench() {  # $1: the name its output is kept under
    timeout -k 5 "${BENCH_SECONDS:-100}" python3 -m kernels.attn_res.bench --impls longweave ${BENCH_ARGS:-} \
      > "$OUT/attn_res_bench_$1.txt" 2>&1
    echo "== $1"; grep -v Warn "$OUT/attn_res_bench_$1.txt" | grep -i "longweave\|error"
  }
  bench tree
  cp kernels/attn_res/mix.py /tmp/mix_tree.py
  for variant in kernels/attn_res/mix_*.py; do
    [ -f "$variant" ] || continue
    cp "$variant" kernels/attn_res/mix.py
    bench "$(basename "$variant" .py)"
  done
  cp /tmp/mix_tree.py kernels/attn_res/mix.py
fi
if [ "${STAGE:-1}" = 1 ]; then
  # STAGE_CONFIG may name several configs (an A/B in one call, the caches shared): each runs in turn, within
  # STAGE_SECONDS, as /tmp/run-N; its metrics come back as metrics-N.jsonl, its log as train-N.log, its profiled
  # step S as profile-N-stepS.txt / .csv (so the runs of an A/B keep theirs). An entry VAR=value@config runs that
  # config with VAR set (LONGWEAVE_ATTENTION=flex@devrun/gpu_small_8k_h100.yaml). An entry tree=DIR@config runs that
  # config on DIR's files put over the tree's (an A/B against a baseline in one call: prepare it here, untracked,
  # with `git archive COMMIT kernels trainer vision | tar x -C devrun/ab_before`); the tree's own folders come back
  # after it, whole, so files only the baseline has leave with it.
  keep_profile() { for f in $run/profile-step*; do [ -f "$f" ] && cp "$f" "$OUT/profile-$n-${f##*/profile-}"; done; }
  n=0
  for entry in ${STAGE_CONFIG:-$default_config}; do
    config=${entry##*@}; settings=; tree=
    [ "$entry" != "$config" ] && settings=${entry%@*}
    case "$settings" in tree=*) tree=${settings#tree=}; settings=;; esac
    if [ -n "$tree" ]; then
      rm -rf /tmp/tree_saved && mkdir -p /tmp/tree_saved
      for d in $(ls "$tree"); do cp -r "$d" /tmp/tree_saved/; done
      cp -r "$tree/." .
    fi
    n=$((n + 1)); run=/tmp/run-$n
    rm -rf "$run"  # a warm machine keeps /tmp: the trainer would take an earlier call's run for one to resume
    echo "== $n: $entry"
    # The copier's output goes nowhere: a background job holding the call's stdout keeps a `| tee` open to the limit
    # (2026-12-04: 140 s of device time lost that way).
    (while sleep 5; do cp $run/metrics.jsonl "$OUT/metrics-$n.jsonl"; keep_profile; done) >/dev/null 2>&1 &
    copier=$!
    env $settings PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 "${STAGE_SECONDS:-390}" \
      python3 -m trainer.train --run $run --config "$config" > "$OUT/train-$n.log" 2>&1
    kill $copier
    if [ -n "$tree" ]; then for d in $(ls "$tree"); do rm -rf "$d"; cp -r "/tmp/tree_saved/$d" .; done; fi
    cp $run/metrics.jsonl "$OUT/metrics-$n.jsonl" 2>/dev/null; keep_profile 2>/dev/null
    if grep -q "INFO.*step [0-9]" "$OUT/train-$n.log"; then grep "INFO.*step [0-9]" "$OUT/train-$n.log" | tail -6
    else echo "no step finished; the log ends:"; grep -v Warn "$OUT/train-$n.log" | tail -4; fi
    grep -i -m5 "error\|out of memory" "$OUT/train-$n.log"
  done
  for f in "$OUT"/profile-*-step*.txt; do [ -f "$f" ] && echo "== $f" && sed -n '/GPU time per step by kind/,$p' "$f"; done
fi
