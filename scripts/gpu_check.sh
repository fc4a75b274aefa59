#!/usr/bin/env bash
# The GPU check (docs/gpu.md): one command on a bare lent GPU machine, the kit `make gpu-kit` built
# here carried along (build/gpu-kit.tar.xz). Checks the machine (each problem one `error:` line, in
# seconds), unpacks the kit, then scripts/gpu_check.py: correctness, the benchmark files, the
# benchmark; the tables and the JSON go to OUTDIR.
#
#   scripts/gpu_check.sh OUTDIR [--rehearse] [gpu_check.py options, e.g. --deadline 300]
#
# GPU_KIT=FILE: another kit; PYTHON=...: another Python 3.12 (default python3, PyTorch's there).
#
# --rehearse: the same on this machine with the Vulkan kit (build/gpu-kit-vulkan.tar.xz) on Mesa's
# lavapipe and tiny sizes (make gpu-rehearse).
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "error: $*" >&2; exit 2; }
[ $# -ge 1 ] && [ "${1#-}" = "$1" ] || die "usage: scripts/gpu_check.sh OUTDIR [--rehearse] [options]"
OUTDIR=$1; shift
REHEARSE=
[ "${1:-}" = --rehearse ] && { REHEARSE=--rehearse; shift; }

if [ -n "$REHEARSE" ]; then
    KIT_TAR=build/gpu-kit-vulkan.tar.xz; PYTHON=${PYTHON:-build/kit-venv/bin/python}
    mkdir -p build/xdg && chmod 700 build/xdg
    export GGML_VK_VISIBLE_DEVICES=0 XDG_RUNTIME_DIR=$PWD/build/xdg   # lavapipe, a CPU-type device
else
    KIT_TAR=build/gpu-kit.tar.xz; PYTHON=${PYTHON:-python3}
    command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this machine has no NVIDIA driver"
    nvidia-smi -L 2>/dev/null | grep -q '^GPU' || die "nvidia-smi lists no GPU: $(nvidia-smi -L 2>&1 | head -1)"
fi
KIT_TAR=${GPU_KIT:-$KIT_TAR}
[ -e "$KIT_TAR" ] || die "no kit at $KIT_TAR: run 'make gpu-kit${REHEARSE:+-vulkan}' and carry it"

command -v xz >/dev/null || die "xz not found: the kit cannot be unpacked"
KIT=${TMPDIR:-/tmp}/pyedgemoe-gpu-kit
rm -rf "$KIT" && mkdir -p "$KIT" && tar -xJf "$KIT_TAR" -C "$KIT"
[ "$(cat "$KIT/STAMP")" = "$(scripts/native_stamp.sh)" ] ||
    die "stale kit: built from other native sources (kit $(cat "$KIT/STAMP"), tree $(scripts/native_stamp.sh)): run make gpu-kit again"

# CUDA's libraries: the runtime and cuBLAS of the Python's NVIDIA wheels (PyTorch's), else CUDA's own
if [ -z "$REHEARSE" ]; then
    SITE=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13; do
        found=$(find "$SITE/nvidia" /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib -name "$lib" 2>/dev/null | head -1 || true)
        [ -n "$found" ] || die "CUDA library $lib not found (in $SITE/nvidia or /usr/local/cuda)"
        LD_LIBRARY_PATH=$(dirname "$found"):${LD_LIBRARY_PATH:-}
    done
fi
export LD_LIBRARY_PATH=$KIT/lib:${LD_LIBRARY_PATH:-}
missing=$(ldd "$KIT"/lib/*.so* "$KIT/bin/llama-bench" 2>&1 | grep 'not found' | sort -u | tr -s ' \t\n' ' ' || true)
[ -z "$missing" ] || die "the kit's libraries need what this machine lacks: $missing"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null ||
    die "the kit's module is built for Python 3.12; $PYTHON is $("$PYTHON" -V 2>&1)"

"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$KIT/site" "$KIT"/wheels/*.whl >/dev/null ||
    die "could not install the kit's wheels ($KIT/wheels)"
export PYTHONPATH=$PWD:$KIT/site PYEDGEMOE_NATIVE=$(ls "$KIT"/lib/_native*.so) PYTHONUNBUFFERED=1
gpu=$("$PYTHON" -c 'from pyedgemoe.devices import gpu_devices as g; d = g(); print(d[0]["name"] if d else "")' 2>&1 | tail -1) ||
    die "the kit's module does not load: $gpu"
[ -n "$gpu" ] || die "the kit's module sees no GPU (ggml found no device of its backend)"
echo "gpu-check: kit $(cat "$KIT/STAMP") on $gpu"
exec "$PYTHON" scripts/gpu_check.py --kit "$KIT" --out "$OUTDIR" $REHEARSE "$@"
