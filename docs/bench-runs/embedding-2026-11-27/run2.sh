#!/bin/bash
cd "$(git rev-parse --show-toplevel)"
F=build/bench/olmoe-L4-q8_0.gguf
B=".venv/bin/pyedgemoe bench $F --ours-only --prompt-tokens 16 --output-tokens 64 --repeats 2 --threads 2"
$B --mem-cap 100% --expert-cache mmap --json build/nearfit/L4-100-mmap.json
$B --expert-cache mmap --json build/nearfit/L4-nocap-mmap.json
$B --json build/nearfit/L4-nocap-auto.json
