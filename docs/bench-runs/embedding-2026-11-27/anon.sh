#!/bin/bash
# anon.sh FILE FRACTION: a mapped run under a cap; the cgroup's largest anonymous memory (rss) seen
F=$1; FR=$2
cd "$(git rev-parse --show-toplevel)"
CG=/sys/fs/cgroup/memory$(grep memory /proc/self/cgroup | cut -d: -f3)/anon-run
rmdir $CG 2>/dev/null; mkdir -p $CG
L=$(python3 -c "print(int($(stat -c %s $F)*$FR))"); echo $L > $CG/memory.limit_in_bytes
.venv/bin/python -c "from pyedgemoe.sysmem import evict_from_page_cache; evict_from_page_cache('$F')"
( while [ -d $CG ]; do awk '$1=="total_rss"||$1=="rss"{print $2}' $CG/memory.stat 2>/dev/null | head -1; sleep 0.2; done ) > /tmp/anon.samples &
S=$!
bash -c "echo \$\$ > $CG/cgroup.procs; exec .venv/bin/pyedgemoe run $F --expert-cache mmap -p hello -n 64 --ctx 96 --temp 0" > /dev/null 2>&1
kill $S 2>/dev/null
echo "limit $L max_anon $(sort -n /tmp/anon.samples | tail -1)"
