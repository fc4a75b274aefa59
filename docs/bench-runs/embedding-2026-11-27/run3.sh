#!/bin/bash
cd "$(git rev-parse --show-toplevel)"
F=build/bench/mixtral-L2-q4_k.gguf
B=".venv/bin/pyedgemoe bench $F --ours-only --prompt-tokens 16 --output-tokens 64 --repeats 3 --threads 2"
$B --mem-cap 100% --expert-cache mmap --json build/nearfit/mx-100-mmap.json
$B --mem-cap 100% --expert-cache 100%~ --json build/nearfit/mx-100-cache.json
$B --expert-cache mmap --json build/nearfit/mx-nocap-mmap.json
