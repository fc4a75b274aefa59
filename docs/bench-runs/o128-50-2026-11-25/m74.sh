#!/bin/bash
# a cell missing from the matrix: OLMoE prompt 128 / output 128 at the 50 % cap; default options, both engines in one call, 3 repeats after the warm-up run
cd /work/main
B=build/bench; O=$B/m74; mkdir -p $O
.venv/bin/pyedgemoe bench $B/olmoe-1b-7b-L16-q8_0.gguf --prompt-tokens 128 --output-tokens 128 --repeats 3 --threads 2 \
  --mem-cap 50% --json $O/O50-p128-o128.json > $O/O50-p128-o128.log 2>&1
echo done > $O/DONE
