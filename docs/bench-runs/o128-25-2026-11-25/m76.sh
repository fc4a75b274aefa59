#!/bin/bash
# m75's remaining cells after its machine was shut down (a new machine: the bench files rebuilt, same seed):
# prompt 128 / output 128 for Qwen3, then prompt 16 and 128 / output 128 for OLMoE, at the 25 % caps;
# default options, both engines in one call, 3 repeats after the warm-up run
cd /work/main
B=build/bench; O=$B/m76; mkdir -p $O
[ -e $B/qwen3-30b-a3b-L12-q4_k.gguf ] || .venv/bin/python scripts/make_synthetic_gguf.py --geometry qwen3-30b-a3b --layers 12 --type q4_k -o $B/qwen3-30b-a3b-L12-q4_k.gguf > $O/gen-qwen3.log 2>&1
[ -e $B/olmoe-1b-7b-L16-q8_0.gguf ] || .venv/bin/python scripts/make_synthetic_gguf.py --geometry olmoe-1b-7b --layers 16 -o $B/olmoe-1b-7b-L16-q8_0.gguf > $O/gen-olmoe.log 2>&1
.venv/bin/pyedgemoe bench $B/qwen3-30b-a3b-L12-q4_k.gguf --prompt-tokens 128 --output-tokens 128 --repeats 3 --threads 2 \
  --mem-cap 25% --stock-no-repack --json $O/Q25-p128-o128.json > $O/Q25-p128-o128.log 2>&1
for P in 16 128; do
  .venv/bin/pyedgemoe bench $B/olmoe-1b-7b-L16-q8_0.gguf --prompt-tokens $P --output-tokens 128 --repeats 3 --threads 2 \
    --mem-cap 25% --json $O/O25-p$P-o128.json > $O/O25-p$P-o128.log 2>&1
done
echo done > $O/DONE
