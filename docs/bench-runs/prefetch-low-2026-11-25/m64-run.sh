#!/bin/bash
# prefetch on the multi-precision files at 25 % with every prefetch waited for at each layer: tokens the same in every run? speed against no prefetch
cd /work/main
B=".venv/bin/pyedgemoe bench"
for m in "O build/bench/olmoe-1b-7b-L16-q8_0-q2_K.mp.gguf 1840125952" "Q build/bench/qwen3-30b-a3b-L12-q4_k-q2_K.mp.gguf 1143287808"; do set -- $m
$B $2 --prompt-tokens 16 --output-tokens 32 --repeats 4 --threads 2 --mem-cap $3 --ours-only --ours-option prefetch=fate --ours-option n_threads=1 --json build/bench/m64/$1-fate.json > build/bench/m64/$1-fate.log 2>&1
$B $2 --prompt-tokens 16 --output-tokens 32 --repeats 3 --threads 2 --mem-cap $3 --ours-only --ours-option n_threads=2 --json build/bench/m64/$1-none.json > build/bench/m64/$1-none.log 2>&1
done
echo done > build/bench/m64/DONE
