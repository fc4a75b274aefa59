#!/bin/bash
# the compute floor on this machine (as m62): Qwen3 HIGH file uncapped, prompt 128, stock --no-repack against ours with every expert cached (plain pools)
cd /work/main
B=build/bench; O=$B/m79; F=$B/qwen3-30b-a3b-L12-q4_k.gguf; mkdir -p $O
run() { local name=$1 eng=$2; shift 2
  .venv/bin/pyedgemoe bench $F --prompt-tokens 128 --output-tokens 4 --repeats 3 --threads 2 --engines $eng "$@" --json $O/$name.json > $O/$name.log 2>&1; }
run stock-norepack llama_cpp --stock-no-repack
run ours-plain pyedgemoe --expert-cache 12GiB --ours-option fill_background=false --ours-option repack=false
echo done > $O/DONE
