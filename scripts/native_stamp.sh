#!/usr/bin/env bash
# The native sources' fingerprint: a GPU kit records the one it was built from, and the GPU check
# refuses a kit whose fingerprint is not the tree's (scripts/gpu_kit.sh, scripts/gpu_check.sh).
cd "$(dirname "$0")/.."
export LC_ALL=C
cat native/CMakeLists.txt native/fetch_llama.py native/patches/*.patch native/toolchain/* native/src/* native/bindings/* | sha256sum | cut -c1-16
