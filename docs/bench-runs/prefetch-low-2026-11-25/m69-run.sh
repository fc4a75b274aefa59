#!/bin/bash
# --system hobbit on the OLMoE multi-precision file at 25 %: HOBBIT's prefetch depth 2 (default) against depth 1 and none, now that each layer waits for the prefetch reads in flight
cd /work/main
B=".venv/bin/pyedgemoe bench"; F=build/bench/olmoe-1b-7b-L16-q8_0-q2_K.mp.gguf; O=build/bench/m69
for r in 1 2; do
for c in "d2 --ours-option prefetch_depth=2" "d1 --ours-option prefetch_depth=1" "none --ours-option prefetch=none"; do set -- $c
$B $F --prompt-tokens 16 --output-tokens 32 --repeats 1 --warmup 0 --threads 2 --mem-cap 1840125952 --ours-only --system hobbit "${@:2}" --json $O/$1-$r.json > $O/$1-$r.log 2>&1
done; done
echo done > $O/DONE
