#!/bin/bash
# output 128 at the caps where the file fits or nearly does (100 %, 110 %, none), both prompts:
# default options, both engines in one call per cap, 3 repeats after the warm-up run
cd /work/main
B=build/bench; O=$B/m77; mkdir -p $O
for C in 100 110 none; do
  CAP=$([ $C = none ] || echo "--mem-cap $C% --stock-no-repack")  # uncapped, both engines repack (as in m52)
  .venv/bin/pyedgemoe bench $B/qwen3-30b-a3b-L12-q4_k.gguf --prompt-tokens 16 --prompt-tokens 128 --output-tokens 128 --repeats 3 \
    --threads 2 $CAP --json $O/Q$C-o128.json > $O/Q$C-o128.log 2>&1
  .venv/bin/pyedgemoe bench $B/olmoe-1b-7b-L16-q8_0.gguf --prompt-tokens 16 --prompt-tokens 128 --output-tokens 128 --repeats 3 \
    --threads 2 ${CAP% --stock-no-repack} --json $O/O$C-o128.json > $O/O$C-o128.log 2>&1
done
echo done > $O/DONE
