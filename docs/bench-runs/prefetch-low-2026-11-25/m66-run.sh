#!/bin/bash
# auto prefetch on the multi-precision files at 25 %: the new default (fate on its core, no extra) against n_threads=2 (no prefetch); prompt 16 and 128, output 32, 3 repeats
cd /work/main
B=".venv/bin/pyedgemoe bench"
for m in "O build/bench/olmoe-1b-7b-L16-q8_0-q2_K.mp.gguf 1840125952" "Q build/bench/qwen3-30b-a3b-L12-q4_k-q2_K.mp.gguf 1143287808"; do set -- $m
$B $2 --prompt-tokens 16 --prompt-tokens 128 --output-tokens 32 --repeats 3 --threads 2 --mem-cap $3 --ours-only --json build/bench/m66/$1-auto.json > build/bench/m66/$1-auto.log 2>&1
$B $2 --prompt-tokens 16 --prompt-tokens 128 --output-tokens 32 --repeats 3 --threads 2 --mem-cap $3 --ours-only --ours-option n_threads=2 --json build/bench/m66/$1-none.json > build/bench/m66/$1-none.log 2>&1
done
echo done > build/bench/m66/DONE
