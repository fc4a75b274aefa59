#!/bin/bash
# gcc -O2 -o m71-paced-reader m71-paced-reader.c first
# the mixed prefill floor (Qwen3 mp, every copy cached, prompt 128) alone and beside a paced O_DIRECT
# reader of another file at 1.1 GB/s (ours' rate in the capped prompt) into huge pages / 4 KiB pages
cd /work/main
B=build/bench; O=$B/m71; F=$B/qwen3-30b-a3b-L12-q4_k-q2_K.mp.gguf; R=$B/olmoe-1b-7b-L16-q8_0.gguf
run() { .venv/bin/pyedgemoe bench $F --prompt-tokens 128 --output-tokens 4 --repeats 3 --threads 2 --engines pyedgemoe --expert-cache 12GiB --json $O/$1.json > $O/$1.log 2>&1; }
for r in 1 2; do
  run alone-$r
  ./m71-paced-reader $R 1 1622016 1100 100000 > $O/huge-$r.rd & P=$!; run huge-$r; kill $P
  ./m71-paced-reader $R 0 1622016 1100 100000 > $O/small-$r.rd & P=$!; run small-$r; kill $P
done
echo done > $O/DONE
