#!/bin/bash
# the cache with the input embedding mapped (its room counted) against the mapped experts, near fit
cd "$(git rev-parse --show-toplevel)"
b() { f=$1; cap=$2; ec=$3; name=$4
  .venv/bin/pyedgemoe bench build/bench/$f.gguf --ours-only --prompt-tokens 16 --output-tokens 64 --repeats 3 --threads 2 \
    --mem-cap $cap --expert-cache "$ec" --json build/nearfit/$name.json; }
b olmoe-L4-q8_0 100% 100%~ e-L4-100-cache
b olmoe-L16-q8_0 100% 100%~ e-L16-100-cache
b qwen3-L6-q4k-exported 95% 100%~ e-q6-95-cache
b qwen3-L6-q4k-exported 95% mmap e-q6-95-mmap
b qwen3-L6-q4k-exported 100% 100%~ e-q6-100-cache
b qwen3-L6-q4k-exported 100% mmap e-q6-100-mmap
b mixtral-L2-q4_k 100% 100%~ e-mx-100-cache
b qwen3-L2-q4_k 90% 100%~ e-q2-90-cache
b qwen3-L2-q4_k 90% mmap e-q2-90-mmap
b qwen3-L2-q4_k 100% 100%~ e-q2-100-cache
b qwen3-L2-q4_k 100% mmap e-q2-100-mmap
