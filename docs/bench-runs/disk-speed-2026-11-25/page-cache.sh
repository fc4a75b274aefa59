# the file in the page cache (24 GiB RAM, no cap), a 20 % expert cache read with buffered io:
# reads at page-cache speed
F=build/bench/olmoe-1b-7b-L16-q8_0.gguf
cat $F > /dev/null
.venv/bin/pyedgemoe bench $F --ours-only --prompt-tokens 16 --output-tokens 32 --repeats 3 --warmup 1 --expert-cache 20% --io buffered --json fast-auto.json
.venv/bin/pyedgemoe bench $F --ours-only --prompt-tokens 16 --output-tokens 32 --repeats 3 --warmup 1 --expert-cache 20% --io buffered --threads 2 --json fast-t2.json
