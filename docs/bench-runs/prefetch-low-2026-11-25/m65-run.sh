#!/bin/bash
# lossy prefetch made timing-free (layers wait for prefetch reads; Fate's extra fixed): same tokens and counts in every run? speed against none; fate_extra 0 against the default (k)
cd /work/main
B=".venv/bin/pyedgemoe bench"
for m in "O build/bench/olmoe-1b-7b-L16-q8_0-q2_K.mp.gguf 1840125952" "Q build/bench/qwen3-30b-a3b-L12-q4_k-q2_K.mp.gguf 1143287808"; do set -- $m
$B $2 --prompt-tokens 16 --output-tokens 32 --repeats 4 --threads 2 --mem-cap $3 --ours-only --ours-option prefetch=fate --ours-option n_threads=1 --json build/bench/m65/$1-fate.json > build/bench/m65/$1-fate.log 2>&1
$B $2 --prompt-tokens 16 --output-tokens 32 --repeats 3 --threads 2 --mem-cap $3 --ours-only --ours-option n_threads=2 --json build/bench/m65/$1-none.json > build/bench/m65/$1-none.log 2>&1
$B $2 --prompt-tokens 16 --output-tokens 32 --repeats 3 --threads 2 --mem-cap $3 --ours-only --ours-option prefetch=fate --ours-option n_threads=1 --ours-option fate_extra=0 --json build/bench/m65/$1-fate-x0.json > build/bench/m65/$1-fate-x0.log 2>&1
done
echo done > build/bench/m65/DONE
