#!/bin/bash
# share.sh FILE CAP_FRACTION -> the rule's shares inside a cgroup capped at that share of the file
F=$1; FR=$2
CG=/sys/fs/cgroup/memory$(grep memory /proc/self/cgroup | cut -d: -f3)/nearfit-share
rmdir $CG 2>/dev/null; mkdir -p $CG
SZ=$(stat -c %s $F)
L=$(python3 -c "print(int($SZ*$FR))"); echo $L > $CG/memory.limit_in_bytes
cd "$(git rev-parse --show-toplevel)"
bash -c "echo \$\$ > $CG/cgroup.procs; exec .venv/bin/python docs/bench-runs/embedding-2026-11-27/share.py $F ${3:-512}"
