#!/bin/bash
# Mixtral L2 at 50 %: first token with the budget auto gives now (the embedding's room in it) and before
cd "$(git rev-parse --show-toplevel)"
old=$((528 << 20))
for r in 1 2; do
  for ec in auto $old; do
    .venv/bin/pyedgemoe bench build/bench/mixtral-L2-q4_k.gguf --ours-only --prompt-tokens 16 --output-tokens 8 --repeats 3 \
      --threads 2 --mem-cap 50% --expert-cache $ec --json build/nearfit/m-mx50-$ec-r$r.json
  done
done
