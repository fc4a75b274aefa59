B=/sys/fs/cgroup/blkio/thr; mkdir -p $B; echo "254:0 314572800" > $B/blkio.throttle.read_bps_device  # reads at 300 MiB/s
F=build/bench/olmoe-1b-7b-L16-q8_0.gguf
echo $$ > $B/tasks
for r in 1 2; do
.venv/bin/pyedgemoe bench $F --ours-only --prompt-tokens 16 --output-tokens 32 --repeats 1 --warmup 0 --mem-cap 75% --json /tmp/thr-auto-$r.json 2>&1 | grep -E "^\| olmoe"
.venv/bin/pyedgemoe bench $F --ours-only --prompt-tokens 16 --output-tokens 32 --repeats 1 --warmup 0 --mem-cap 75% --prefetch fate --ours-option n_threads=1 --ours-option n_threads_batch=2 --json /tmp/thr-pf-$r.json 2>&1 | grep -E "^\| olmoe"
done
