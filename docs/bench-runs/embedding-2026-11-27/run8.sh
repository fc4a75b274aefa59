#!/bin/bash
# near fit: a cache that holds (nearly) every expert, filled only by its misses (no fill)
cd "$(git rev-parse --show-toplevel)"
b() { f=$1; cap=$2; name=$3; shift 3
  .venv/bin/pyedgemoe bench build/bench/$f.gguf --ours-only --prompt-tokens 16 --output-tokens 64 --repeats 3 --threads 2 \
    --mem-cap $cap --json build/nearfit/$name.json "$@"; }
b qwen3-L2-q4_k 100% h-q2-100-nofill --expert-cache 100%~ --no-fill-cache
b qwen3-L6-q4k-exported 100% h-q6-100-nofill --expert-cache 100%~ --no-fill-cache
b olmoe-L16-q8_0 100% h-L16-100-nofill --expert-cache 100%~ --no-fill-cache
b mixtral-L2-q4_k 100% h-mx-100-nofill --expert-cache 100%~ --no-fill-cache
