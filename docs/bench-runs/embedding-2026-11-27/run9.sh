#!/bin/bash
# near fit, longer runs: a cache holding every expert (background fill) against the mapped file
cd "$(git rev-parse --show-toplevel)"
for ec in mmap 100%~; do
  .venv/bin/pyedgemoe bench build/bench/qwen3-L6-q4k-exported.gguf --ours-only --prompt-tokens 16 --output-tokens 256 \
    --repeats 3 --threads 2 --mem-cap 100% --expert-cache $ec --json build/nearfit/j-q6-100-o256-${ec%\%~}.json
done
