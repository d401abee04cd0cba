#!/bin/bash
# FlexAttention's kernel options against its defaults and varlen, for the decoder's causal documents and the vision
# tower's images (vision.attention_bench --flex-options; BENCHMARKS.md says which set won). Run after the wheel-install
# prefix; results in $OUT/flex_*.txt and $OUT/flex.jsonl. SECONDS_EACH bounds each case (default 150), CASES picks
# some (default: all three).
set -u
each=${SECONDS_EACH:-150}
causal=('{"USE_TMA": true}' '{"PRESCALE_QK": true}'
        '{"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64, "bwd_num_warps": 4, "bwd_num_stages": 3}'
        '{"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2}')
tower=('{"USE_TMA": true}'
       '{"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64, "bwd_num_warps": 8, "bwd_num_stages": 3}'
       '{"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 3}')
run() {  # $1: name; the rest: attention_bench's arguments
  local name=$1; shift
  case " ${CASES:-decoder tower1296 tower4096} " in *" $name "*) ;; *) return;; esac
  timeout -k 5 "$each" python3 -m vision.attention_bench "$@" --json "$OUT/flex.jsonl" > "$OUT/flex_$name.txt" 2>&1
  echo "== $name (exit $?)"; grep -v "Warn\|warn" "$OUT/flex_$name.txt" | tail -9
}
run decoder --tokens 65536 --flex-options "${causal[@]}"
# The 8k stage's images (.devdata): most of 1,296 patches, the largest 4,096.
run tower1296 --bidirectional --heads 8 --head-dim 64 --tokens 41472 --sample 1296 --docs-per-sample 1 \
  --flex-options "${tower[@]}"
run tower4096 --bidirectional --heads 8 --head-dim 64 --tokens 40960 --sample 4096 --docs-per-sample 1 \
  --flex-options "${tower[@]}"
