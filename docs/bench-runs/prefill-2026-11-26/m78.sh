#!/bin/bash
# Qwen3 25 % mixed prefill on a new machine: the multi-precision file and its calibration made again
# (the Makefile target), then ours (defaults) against stock --no-repack, prompt 128, output 8, 4 rounds alternating
cd /work/main
B=build/bench; O=$B/m78; mkdir -p $O
make build/bench/qwen3-30b-a3b-L12-q4_k-q2_K.mp.gguf.calibration.json > $O/make.log 2>&1 || exit 1
run() { local name=$1 file=$2 eng=$3; shift 3
  .venv/bin/pyedgemoe bench $B/$file --prompt-tokens 128 --output-tokens 8 --repeats 1 --threads 2 --mem-cap 1143287808 --engines $eng "$@" --json $O/$name.json > $O/$name.log 2>&1; }
QM=qwen3-30b-a3b-L12-q4_k-q2_K.mp.gguf; QH=qwen3-30b-a3b-L12-q4_k.gguf
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then run stock-$r $QH llama_cpp --stock-no-repack; run mixed-$r $QM pyedgemoe
  else run mixed-$r $QM pyedgemoe; run stock-$r $QH llama_cpp --stock-no-repack; fi
done
echo done > $O/DONE
