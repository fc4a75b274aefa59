#!/bin/bash
# the mixed-precision prefill floor again: Qwen3 mp file, every copy cached, prompt 128, prefill_low_share 0 / 0.75 / 0.99
cd /work/main
B=build/bench; O=$B/m63; F=$B/qwen3-30b-a3b-L12-q4_k-q2_K.mp.gguf
for s in 0 0.75 0.99; do
  .venv/bin/pyedgemoe bench $F --prompt-tokens 128 --output-tokens 4 --repeats 3 --threads 2 --engines pyedgemoe --expert-cache 12GiB --ours-option prefill_low_share=$s --json $O/s$s.json > $O/s$s.log 2>&1
done
echo done > $O/DONE
