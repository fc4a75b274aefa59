#!/bin/bash
# Qwen3 25 % mixed prefill: repacked HIGH pools or not (prompt 128, output 8), stock no-repack beside; 3 rounds alternating
cd /work/main
B=build/bench; O=$B/m61
run() { local name=$1 file=$2 eng=$3; shift 3
  .venv/bin/pyedgemoe bench $B/$file --prompt-tokens 128 --output-tokens 8 --repeats 1 --threads 2 --mem-cap 1143287808 --engines $eng "$@" --json $O/$name.json > $O/$name.log 2>&1; }
QM=qwen3-30b-a3b-L12-q4_k-q2_K.mp.gguf; QH=qwen3-30b-a3b-L12-q4_k.gguf
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then
    run stock-$r $QH llama_cpp --stock-no-repack; run plain-$r $QM pyedgemoe; run repack-$r $QM pyedgemoe --ours-option repack=true
  else
    run repack-$r $QM pyedgemoe --ours-option repack=true; run plain-$r $QM pyedgemoe; run stock-$r $QH llama_cpp --stock-no-repack
  fi
done
echo done > $O/DONE
