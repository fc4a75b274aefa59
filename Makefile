# pyedgemoe: the two commands a fresh machine needs are `make demo` and `make test`.
PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
# GPU variants of our native build (docs/gpu.md): `make setup GGML_VULKAN=1` (glslc, the Vulkan
# loader and Mesa's lavapipe from Debian; Debian 13's headers, native/fetch_vulkan_headers.sh) and
# `make setup GGML_CUDA=1 [CUDA_ARCH=90]` (CUDA 13.0's nvcc, one architecture).
CUDA_ARCH ?= 89
VULKAN_INCLUDE := $(CURDIR)/native/vendor/vulkan/usr/include
CMAKE_ARGS ?= $(if $(GGML_CUDA),$(CUDA_FLAGS),) $(if $(GGML_VULKAN),$(VULKAN_FLAGS),)
export CMAKE_ARGS
# ccache (when installed) keeps rebuilds of llama.cpp cheap, also in another clone's folder (its paths
# are hashed relative to the clone: CI's fresh clone finds what an earlier one compiled).
export CCACHE_DIR ?= $(HOME)/.cache/ccache
export CCACHE_BASEDIR ?= $(CURDIR)

.PHONY: setup setup-test native native-vulkan native-cuda test test-fast test-device demo bench clean vulkan-deps \
        ui browser-deps \
        gpu-kit gpu-kit-vulkan gpu-rehearse

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip==26.3

# Build deps, the vendored+patched llama.cpp and our package (editable: a rebuild is `make native`).
$(VENV)/.setup-done: $(if $(GGML_VULKAN),vulkan-deps) $(VENV)/bin/activate $(if $(GGML_CUDA),$(CUBLAS)) pyproject.toml native/CMakeLists.txt native/fetch_llama.py $(wildcard native/patches/*.patch native/src/* native/bindings/*)
	$(PIP) install --quiet scikit-build-core==1.1.2 nanobind==3.1.0 cmake==4.4.4 ninja==1.13.2
	$(PY) native/fetch_llama.py
	$(PIP) install --quiet --no-build-isolation -e .
	touch $@

setup: $(VENV)/.setup-done

# What the Vulkan variant needs from Debian (as root), and headers new enough for ggml-vulkan.
vulkan-deps:
	command -v glslc >/dev/null && [ -e /usr/share/vulkan/icd.d/lvp_icd.x86_64.json ] || \
	  apt-get install -y -q glslc libvulkan-dev mesa-vulkan-drivers spirv-headers
	native/fetch_vulkan_headers.sh

native:
	rm -f $(VENV)/.setup-done
	$(MAKE) setup

# Test-only references: stock llama-cpp-python (built from its sdist), torch (CPU), transformers;
# and the server's extra (FastAPI, uvicorn), which tests/test_server.py runs.
# Stock's build from its sdist gets native/toolchain/gcc-tile-config.h before every C++ file (CXXFLAGS: a
# first configure's, so not our module's, configured already), never a wheel built without it.
$(VENV)/.test-deps-done: $(VENV)/.setup-done pyproject.toml
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" CXXFLAGS="-include $(CURDIR)/native/toolchain/gcc-tile-config.h" \
	  $(PIP) install --quiet --no-build-isolation --no-cache-dir -e ".[test,server]"
	touch $@

setup-test: $(VENV)/.test-deps-done browser-deps

# Debian's chromium, which tests/test_server_web_ui.py drives with Playwright (as root; where it
# cannot be installed those tests skip and say so).
browser-deps:
	command -v chromium >/dev/null || { apt-get update -q && apt-get install -y -q chromium; } >/dev/null 2>&1 || \
	  echo "note: chromium not installed: the browser tests will skip"

# llama.cpp's web UI from the vendored sources (npm, its pinned lock) into build/ui/dist, which
# `pyedgemoe serve` serves at /; not part of setup (npm's registry, minutes): docs/server.md.
ui: setup
	scripts/build_ui.sh

# GPU variants of the native module, built beside the installed one (same sources, plus one of
# ggml's GPU backends) into build/<variant>-native; PYEDGEMOE_NATIVE=<its .so> makes pyedgemoe use
# it. make test runs the device tests (tests/device) with the Vulkan variant on Mesa's lavapipe,
# a Vulkan device on the CPU (docs/gpu.md).
VULKAN_FLAGS := -DGGML_VULKAN=ON -DVulkan_INCLUDE_DIR=$(VULKAN_INCLUDE)
# CUDA 13.0 here is nvcc and the runtime without cuBLAS or the driver library: cuBLAS comes from
# PyPI (nvidia-cublas), and without libcuda.so to link the build leaves out ggml's VMM pool
# (GGML_CUDA_NO_VMM: the runtime finds the driver itself).
CUBLAS       := $(CURDIR)/build/cuda-deps/nvidia/cu13
CUDA_FLAGS   := -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCH) -DCMAKE_CUDA_COMPILER=/usr/local/cuda-13.0/bin/nvcc \
                -DGGML_CUDA_NO_VMM=ON -DCUDA_cublas_LIBRARY=$(CUBLAS)/lib/libcublas.so.13 \
                -DCUDA_cublasLt_LIBRARY=$(CUBLAS)/lib/libcublasLt.so.13 -DCMAKE_CUDA_FLAGS=-I$(CUBLAS)/include
define build_variant
	$(VENV)/bin/cmake -S native -B build/$(1)-native -G Ninja -DCMAKE_MAKE_PROGRAM=$(CURDIR)/$(VENV)/bin/ninja \
	  -DCMAKE_BUILD_TYPE=Release $(2) -DPython_EXECUTABLE=$(CURDIR)/$(PY) >/dev/null
	$(VENV)/bin/cmake --build build/$(1)-native --target _native
endef
DEVICE_TEST_ENV = PYEDGEMOE_NATIVE=$$(ls build/vulkan-native/_native*.so) PYEDGEMOE_REQUIRE_GPU=1 \
                  GGML_VK_VISIBLE_DEVICES=0 XDG_RUNTIME_DIR=$(CURDIR)/build/xdg

native-vulkan: vulkan-deps setup
	$(call build_variant,vulkan,$(VULKAN_FLAGS))

# Compiles (CUDA 13.0's nvcc, one architecture: CUDA_ARCH); runs where a GPU is lent.
native-cuda: setup $(CUBLAS)
	$(call build_variant,cuda,$(CUDA_FLAGS))

$(CUBLAS):
	$(PIP) install --quiet --no-deps --target build/cuda-deps nvidia-cublas==13.0.2.14

test-device: setup-test native-vulkan
	mkdir -p build/xdg && chmod 700 build/xdg
	$(DEVICE_TEST_ENV) $(PY) -m pytest -q tests/device

# The CPU suite's files on TEST_WORKERS processes (pytest-xdist; a file's tests in one, as its fixtures
# are module-scoped; the tiny models are built under a lock): in one process it keeps about one core
# busy (fresh clones on 2 cores: 29.6 min in one process, 19 on two workers; tests/conftest.py makes
# ggml's OpenMP threads wait passively, without which the two workers' spinning threads took 29).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

test: setup-test
	$(PY) -m pytest -q $(XDIST) tests --ignore=tests/device
	$(MAKE) test-device

# The same without the tests marked slow (more than ~5 s each on 2 cores).
test-fast: setup-test
	$(PY) -m pytest -q $(XDIST) -m "not slow" tests --ignore=tests/device

# The GPU check (docs/gpu.md). gpu-kit: what a lent GPU machine runs, built here (CUDA sm_90, about
# 20 minutes on 2 cores; with ccache a rebuild after a change of ours takes a minute): build/gpu-kit.tar.xz,
# carried to the device, where scripts/gpu_check.sh OUTDIR runs everything. gpu-rehearse: the same
# command end to end here, with the Vulkan kit on lavapipe and tiny sizes (every cell: lavapipe on 2
# cores needs far more than the device's deadline of 450 s); then a rerun with the variants the next
# device session's second run adds (docs/gpu.md), on the files the first wrote.
gpu-kit: setup-test $(CUBLAS)
	scripts/gpu_kit.sh

gpu-kit-vulkan: setup-test vulkan-deps
	scripts/gpu_kit.sh --vulkan

REHEARSAL_DEPS := numpy==2.5.2 typer==0.29.1 jinja2==3.1.6 huggingface_hub==2.4.0 tokenizers==0.23.3 \
                  sentencepiece==0.2.3 pyyaml==6.0.4 tqdm==4.70.1
gpu-rehearse: gpu-kit-vulkan
	build/kit-venv/bin/pip install --quiet $(REHEARSAL_DEPS)
	scripts/gpu_check.sh build/gpu-rehearsal --rehearse --deadline 2400
	scripts/gpu_check.sh build/gpu-rehearsal-variants --rehearse --deadline 1200 --no-correctness --models qwen3 \
	  --budgets 25% --modes split --prefetch hobbit --link-shares 0.7 --low q2_k

demo: setup
	$(PY) scripts/demo.py

# Synthetic OLMoE-1B-7B geometry (16 layers, Q8_0, 7.4 GB, random weights): ours vs stock llama.cpp,
# uncapped and under cgroup memory caps of 50% and 25% of the file (docs/benchmarks.md).
BENCH_MODEL := build/bench/olmoe-1b-7b-L16-q8_0.gguf

$(BENCH_MODEL):
	$(PY) scripts/make_synthetic_gguf.py --geometry olmoe-1b-7b --type q8_0 -o $@

# The same with a LOW copy (Q2_K) of every expert, for HOBBIT's mixed precision, calibrated on a
# text (the sidecar next to it sets T1/T2 and the cache weights; scripts/bench_hobbit.py).
BENCH_MP_MODEL := build/bench/olmoe-1b-7b-L16-q8_0-q2_K.mp.gguf
BENCH_CAP25 := 1840125952  # 25% of $(BENCH_MODEL), the same cap for both files
BENCH_CAP50 := 3680251904  # 50%

$(BENCH_MP_MODEL): $(BENCH_MODEL)
	$(PY) -m pyedgemoe convert $(BENCH_MODEL) -o $@ --low q2_K

# The calibration text: this project's docs.
build/bench/calibration.txt:
	mkdir -p build/bench && cat docs/*.md | head -c 60000 > $@

$(BENCH_MP_MODEL).calibration.json: $(BENCH_MP_MODEL) build/bench/calibration.txt
	$(PY) -m pyedgemoe calibrate $(BENCH_MP_MODEL) -f build/bench/calibration.txt --budget 15% --max-tokens 256 --ctx 128 -t 2 --force

# Synthetic Qwen3-30B-A3B geometry, 12 of its 48 layers (Q4_K, 4.6 GB). Stock llama.cpp repacks
# Q4_K weights into anonymous memory on x86 and is killed under the caps: it runs with --no-repack.
BENCH_QWEN3 := build/bench/qwen3-30b-a3b-L12-q4_k.gguf

$(BENCH_QWEN3):
	$(PY) scripts/make_synthetic_gguf.py --geometry qwen3-30b-a3b --layers 12 --type q4_k -o $@

# Its multi-precision copy (Q4_K HIGH as the file's, Q2_K LOW), calibrated at a 10 % budget.
BENCH_QWEN3_MP := build/bench/qwen3-30b-a3b-L12-q4_k-q2_K.mp.gguf

$(BENCH_QWEN3_MP): $(BENCH_QWEN3)
	$(PY) -m pyedgemoe convert $(BENCH_QWEN3) -o $@ --high q4_K --low q2_K

$(BENCH_QWEN3_MP).calibration.json: $(BENCH_QWEN3_MP) build/bench/calibration.txt
	$(PY) -m pyedgemoe calibrate $(BENCH_QWEN3_MP) -f build/bench/calibration.txt --budget 10% --max-tokens 256 --ctx 128 -t 2 --force

# HOBBIT's grid (prompt 16/128 x output 32/128), median of 3, at every cap. Under the 50 % and 25 %
# caps stock llama.cpp decodes 0.13-0.3 tok/s: the whole target takes most of a day on 2 cores.
BENCH_GRID := --prompt-tokens 16 --prompt-tokens 128 --output-tokens 32 --output-tokens 128

bench: setup-test $(BENCH_MODEL) $(BENCH_MP_MODEL).calibration.json $(BENCH_QWEN3)
	$(PY) -m pyedgemoe bench $(BENCH_MODEL) $(BENCH_GRID)
	$(PY) -m pyedgemoe bench $(BENCH_MODEL) $(BENCH_GRID) --mem-cap 100%
	$(PY) -m pyedgemoe bench $(BENCH_MODEL) $(BENCH_GRID) --mem-cap 50% --expert-cache 40%
	$(PY) -m pyedgemoe bench $(BENCH_MODEL) $(BENCH_GRID) --mem-cap 25% --expert-cache 15%
	$(PY) scripts/bench_hobbit.py $(BENCH_MP_MODEL) --mem-cap $(BENCH_CAP25) --expert-cache 15% --repeats 4
	$(PY) scripts/bench_hobbit.py $(BENCH_MP_MODEL) --mem-cap $(BENCH_CAP50) --expert-cache 40% --repeats 4
	$(PY) -m pyedgemoe bench $(BENCH_QWEN3) $(BENCH_GRID)
	$(PY) -m pyedgemoe bench $(BENCH_QWEN3) $(BENCH_GRID) --mem-cap 100% --stock-no-repack
	$(PY) -m pyedgemoe bench $(BENCH_QWEN3) $(BENCH_GRID) --mem-cap 50% --expert-cache 35% --stock-no-repack
	$(PY) -m pyedgemoe bench $(BENCH_QWEN3) $(BENCH_GRID) --mem-cap 25% --expert-cache 10% --stock-no-repack

clean:
	rm -rf build $(VENV) native/vendor tests/.models
