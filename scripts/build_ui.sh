#!/usr/bin/env bash
# llama.cpp's web UI, built from the sources we vendor (native/vendor/llama.cpp/tools/ui: Svelte),
# with npm from their pinned package-lock.json, into build/ui/dist, where `pyedgemoe serve` finds it
# (pyedgemoe/server/web_ui.py) and serves it at /. `make ui` runs this; nothing else needs it: without
# the UI, / is the server's own page of the expert cache. Needs node >= 20.19 and npm's registry.
#
#     scripts/build_ui.sh            # build/ui/src: a copy of the sources, npm ci there; build/ui/dist
set -euo pipefail
cd "$(dirname "$0")/.."
SOURCES=native/vendor/llama.cpp/tools/ui
WORK=build/ui/src
OUT=build/ui/dist

if [ ! -f "$SOURCES/package-lock.json" ]; then
    echo "build_ui: $SOURCES is missing: run make setup first (it fetches llama.cpp)" >&2
    exit 1
fi
for tool in node npm; do
    command -v "$tool" >/dev/null || { echo "build_ui: $tool is not installed" >&2; exit 1; }
done
# a copy: npm writes node_modules and .svelte-kit beside the sources, which stay as fetched
rm -rf "$WORK" "$OUT"
mkdir -p "$WORK"
cp -a "$SOURCES/." "$WORK/"
cd "$WORK"
# npm can fail and still exit 0 ("Exit handler never called", when its registry is out of reach):
# the build's own tool must be there
if ! npm ci --no-audit --no-fund || [ ! -x node_modules/.bin/vite ]; then
    echo "build_ui: npm ci failed (is npm's registry reachable from here?); / stays the expert cache page" >&2
    exit 1
fi
# the UI's own build (its CMake's step without CMake): icons, then vite into LLAMA_UI_OUT_DIR
LLAMA_UI_OUT_DIR="$(cd ../.. && pwd)/ui/dist" npm run build
test -f ../dist/index.html
echo "build_ui: llama.cpp's web UI is in $OUT"
