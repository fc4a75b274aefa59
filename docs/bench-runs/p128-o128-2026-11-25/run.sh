#!/bin/bash
# cells missing from the matrix where stock's speed allows: prompt 128 / output 128 at the 90 % caps (both geometries) and at OLMoE 75 %; default options, both engines in one call, 3 repeats after the warm-up run
cd /work/main
B=build/bench; O=$B/m70
.venv/bin/pyedgemoe bench $B/qwen3-30b-a3b-L12-q4_k.gguf --prompt-tokens 128 --output-tokens 128 --repeats 3 --threads 2 \
  --mem-cap 90% --stock-no-repack --json $O/Q90-p128-o128.json > $O/Q90-p128-o128.log 2>&1
.venv/bin/pyedgemoe bench $B/olmoe-1b-7b-L16-q8_0.gguf --prompt-tokens 128 --output-tokens 128 --repeats 3 --threads 2 \
  --mem-cap 90% --json $O/O90-p128-o128.json > $O/O90-p128-o128.log 2>&1
.venv/bin/pyedgemoe bench $B/olmoe-1b-7b-L16-q8_0.gguf --prompt-tokens 128 --output-tokens 128 --repeats 3 --threads 2 \
  --mem-cap 75% --json $O/O75-p128-o128.json > $O/O75-p128-o128.log 2>&1
echo done > $O/DONE
