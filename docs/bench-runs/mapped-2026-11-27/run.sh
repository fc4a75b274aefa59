#!/bin/bash
# Mapped experts with the other weights in memory, against stock llama.cpp --no-repack under the
# same cgroup caps (docs/benchmarks.md, "Mapped experts, the other weights in memory"). Run from
# the repository root; nothing else running. Files: scripts/make_synthetic_gguf.py (see README.md).
set -e
out=docs/bench-runs/mapped-2026-11-27
cell() {  # name file cap output repeats
  .venv/bin/pyedgemoe bench "$2" --mem-cap "$3" --stock-no-repack --prompt-tokens 16 --output-tokens "$4" \
    --repeats "$5" --threads 2 --json "$out/$1.json" > "$out/$1.log" 2>&1 || true
  grep "^| " "$out/$1.log" | tail -1
}
cell qwen3-L6-95 build/bench/qwen3-L6-q4k-exported.gguf 95% 64 5
cell qwen3-L6-100 build/bench/qwen3-L6-q4k-exported.gguf 100% 64 5
cell qwen3-L2-95 build/bench/qwen3-L2-q4_k.gguf 95% 64 5
cell qwen3-L2-100 build/bench/qwen3-L2-q4_k.gguf 100% 64 5
cell mixtral-L2-100 build/bench/mixtral-L2-q4_k.gguf 100% 64 5
cell mixtral-L2-25 build/bench/mixtral-L2-q4_k.gguf 25% 32 3
