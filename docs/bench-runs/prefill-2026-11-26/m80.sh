#!/bin/bash
# mixed-precision prefill under the 25/50 % caps on this machine (as m51, without the lossless runs): prompt 128, output 4,
# stock on the HIGH file against ours (defaults) on the multi-precision file, caps in bytes of the HIGH file, 3 rounds, order reversed every other round
cd /work/main
B=build/bench; O=$B/m80; mkdir -p $O
make build/bench/olmoe-1b-7b-L16-q8_0-q2_K.mp.gguf.calibration.json > $O/make.log 2>&1 || exit 1
run() { local name=$1 file=$2 cap=$3 eng=$4; shift 4
  .venv/bin/pyedgemoe bench $B/$file --prompt-tokens 128 --output-tokens 4 --repeats 1 --threads 2 --mem-cap $cap --engines $eng "$@" --json $O/$name.json > $O/$name.log 2>&1; }
cell() { local c=$1 hi=$2 mp=$3 cap=$4 r=$5; shift 5
  if [ $((r % 2)) = 1 ]; then run $c-stock-$r $hi $cap llama_cpp "$@"; run $c-mixed-$r $mp $cap pyedgemoe
  else run $c-mixed-$r $mp $cap pyedgemoe; run $c-stock-$r $hi $cap llama_cpp "$@"; fi; }
for r in 1 2 3; do
  cell O25 olmoe-1b-7b-L16-q8_0.gguf olmoe-1b-7b-L16-q8_0-q2_K.mp.gguf 1840125952 $r
  cell O50 olmoe-1b-7b-L16-q8_0.gguf olmoe-1b-7b-L16-q8_0-q2_K.mp.gguf 3680251904 $r
  cell Q25 qwen3-30b-a3b-L12-q4_k.gguf qwen3-30b-a3b-L12-q4_k-q2_K.mp.gguf 1143287808 $r --stock-no-repack
  cell Q50 qwen3-30b-a3b-L12-q4_k.gguf qwen3-30b-a3b-L12-q4_k-q2_K.mp.gguf 2286575616 $r --stock-no-repack
done
echo done > $O/DONE
