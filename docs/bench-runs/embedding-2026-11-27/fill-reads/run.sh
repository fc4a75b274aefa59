#!/bin/bash
# FILL_READS_PER_THREAD 4 (as built) against 16, alternating, ours only
cd "$(git rev-parse --show-toplevel)"
cell() { f=$1; cap=$2; name=$3; shift 3
  for r in 1 2; do for v in 4 16; do
    PYEDGEMOE_NATIVE=/tmp/fillx/native-$v.so .venv/bin/pyedgemoe bench build/bench/$f.gguf --ours-only --prompt-tokens 16 \
      --output-tokens 64 --repeats 2 --threads 2 --mem-cap $cap --json build/fillx/$name-v$v-r$r.json "$@"
  done; done; }
cell qwen3-L2-q4_k 100% q2-100 --expert-cache 100%~
cell qwen3-L6-q4k-exported 50% q6-50
cell mixtral-L2-q4_k 50% mx-50
cell olmoe-L16-q8_0 100% L16-100
