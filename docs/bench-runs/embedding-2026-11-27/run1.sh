#!/bin/bash
# OLMoE L16 Q8_0: mapped vs cache at 100 % and uncapped
cd "$(git rev-parse --show-toplevel)"
F=build/bench/olmoe-L16-q8_0.gguf
B=".venv/bin/pyedgemoe bench $F --ours-only --prompt-tokens 16 --output-tokens 64 --repeats 2 --threads 2"
$B --mem-cap 100% --expert-cache mmap --json build/nearfit/L16-100-mmap.json
$B --mem-cap 100% --json build/nearfit/L16-100-auto.json
$B --expert-cache mmap --json build/nearfit/L16-nocap-mmap.json
$B --json build/nearfit/L16-nocap-auto.json
