#!/bin/bash
cd "$(git rev-parse --show-toplevel)"
b() { f=$1; name=$2; shift 2
  .venv/bin/pyedgemoe bench build/bench/$f.gguf --ours-only --prompt-tokens 16 --output-tokens 64 --repeats 3 --threads 2 \
    --json build/nearfit/$name.json "$@"; }
b qwen3-L2-q4_k f-q2-nocap-c100 --expert-cache 100%
b qwen3-L2-q4_k f-q2-nocap-c100-nobg --expert-cache 100% --no-fill-background
b qwen3-L2-q4_k f-q2-nocap-mmap --expert-cache mmap
b qwen3-L2-q4_k f-q2-nocap-auto
b qwen3-L2-q4_k f-q2-100-c100-nobg --expert-cache 100%~ --no-fill-background --mem-cap 100%
