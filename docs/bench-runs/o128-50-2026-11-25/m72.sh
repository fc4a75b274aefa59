#!/bin/bash
# cells missing from the matrix: prompt 16 / output 128 at the 50 % caps (both geometries); default options, both engines in one call, 3 repeats after the warm-up run
cd /work/main
B=build/bench; O=$B/m72; mkdir -p $O
.venv/bin/pyedgemoe bench $B/qwen3-30b-a3b-L12-q4_k.gguf --prompt-tokens 16 --output-tokens 128 --repeats 3 --threads 2 \
  --mem-cap 50% --stock-no-repack --json $O/Q50-p16-o128.json > $O/Q50-p16-o128.log 2>&1
.venv/bin/pyedgemoe bench $B/olmoe-1b-7b-L16-q8_0.gguf --prompt-tokens 16 --output-tokens 128 --repeats 3 --threads 2 \
  --mem-cap 50% --json $O/O50-p16-o128.json > $O/O50-p16-o128.log 2>&1
echo done > $O/DONE
