#!/bin/bash
# 50 % caps: ours auto (the embedding's rows mapped, its room in the cache) against stock, and ours
# with the budget auto gave before (less the cold embedding), the embedding's room not counted
cd "$(git rev-parse --show-toplevel)"
for f in qwen3-L6-q4k-exported mixtral-L2-q4_k; do
  .venv/bin/pyedgemoe bench build/bench/$f.gguf --stock-no-repack --prompt-tokens 16 --output-tokens 64 --repeats 3 --threads 2 \
    --mem-cap 50% --json build/nearfit/g-$f-50.json
  old=$(.venv/bin/python -c "
import json; from pyedgemoe.model_info import read_model_info
r=[r for r in json.load(open('build/nearfit/g-$f-50.json')) if r['engine']=='pyedgemoe'][0]
b=r['engine_stats']['experts']['budget_bytes']-read_model_info('build/bench/$f.gguf').cold_embedding_bytes
print(b - b % (16<<20))")
  .venv/bin/pyedgemoe bench build/bench/$f.gguf --ours-only --prompt-tokens 16 --output-tokens 64 --repeats 3 --threads 2 \
    --mem-cap 50% --expert-cache $old --json build/nearfit/g-$f-50-old.json
done
