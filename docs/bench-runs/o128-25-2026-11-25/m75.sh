#!/bin/bash
# the cells missing from the matrix: prompt 16 and 128 / output 128 at the 25 % caps (both geometries); default options, both engines in one call, 3 repeats after the warm-up run
cd /work/main
B=build/bench; O=$B/m75; mkdir -p $O
for P in 16 128; do
  .venv/bin/pyedgemoe bench $B/qwen3-30b-a3b-L12-q4_k.gguf --prompt-tokens $P --output-tokens 128 --repeats 3 --threads 2 \
    --mem-cap 25% --stock-no-repack --json $O/Q25-p$P-o128.json > $O/Q25-p$P-o128.log 2>&1
  .venv/bin/pyedgemoe bench $B/olmoe-1b-7b-L16-q8_0.gguf --prompt-tokens $P --output-tokens 128 --repeats 3 --threads 2 \
    --mem-cap 25% --json $O/O25-p$P-o128.json > $O/O25-p$P-o128.log 2>&1
done
echo done > $O/DONE
