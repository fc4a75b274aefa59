#!/bin/bash
cd "$(git rev-parse --show-toplevel)"
F=build/bench/qwen3-L6-q4k-exported.gguf
B=".venv/bin/pyedgemoe bench $F --ours-only --prompt-tokens 16 --output-tokens 64 --repeats 3 --threads 2"
$B --mem-cap 103% --expert-cache mmap --json build/nearfit/q6-103-mmap.json
$B --mem-cap 103% --expert-cache 100%~ --json build/nearfit/q6-103-cache.json
