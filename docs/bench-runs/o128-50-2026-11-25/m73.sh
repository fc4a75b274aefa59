#!/bin/bash
# a cell missing from the matrix: Qwen3 prompt 128 / output 128 at the 50 % cap; default options, both engines in one call, 3 repeats after the warm-up run
cd /work/main
B=build/bench; O=$B/m73; mkdir -p $O
.venv/bin/pyedgemoe bench $B/qwen3-30b-a3b-L12-q4_k.gguf --prompt-tokens 128 --output-tokens 128 --repeats 3 --threads 2 \
  --mem-cap 50% --stock-no-repack --json $O/Q50-p128-o128.json > $O/Q50-p128-o128.log 2>&1
echo done > $O/DONE
