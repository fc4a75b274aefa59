# pyedgemoe: the two commands a fresh machine needs are `make demo` and `make test`.
PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
# Extra CMake flags for our native build, e.g. `make setup GGML_CUDA=1`.
CMAKE_ARGS ?= $(if $(GGML_CUDA),-DGGML_CUDA=ON,)
export CMAKE_ARGS
# ccache (when installed) keeps rebuilds of llama.cpp cheap.
export CCACHE_DIR ?= $(HOME)/.cache/ccache

.PHONY: setup setup-test native test demo bench clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip==26.3

# Build deps, the vendored+patched llama.cpp and our package (editable: a rebuild is `make native`).
$(VENV)/.setup-done: $(VENV)/bin/activate pyproject.toml native/CMakeLists.txt native/fetch_llama.py $(wildcard native/patches/*.patch native/src/* native/bindings/*)
	$(PIP) install --quiet scikit-build-core==1.1.2 nanobind==3.1.0 cmake==4.4.4 ninja==1.13.2
	$(PY) native/fetch_llama.py
	$(PIP) install --quiet --no-build-isolation -e .
	touch $@

setup: $(VENV)/.setup-done

native:
	rm -f $(VENV)/.setup-done
	$(MAKE) setup

# Test-only references: stock llama-cpp-python (built from its sdist), torch (CPU), transformers.
$(VENV)/.test-deps-done: $(VENV)/.setup-done pyproject.toml
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" $(PIP) install --quiet --no-build-isolation -e ".[test]"
	touch $@

setup-test: $(VENV)/.test-deps-done

test: setup-test
	$(PY) -m pytest -q tests

demo: setup
	$(PY) scripts/demo.py

bench: setup-test
	$(PY) -m pyedgemoe.cli bench build/bench/olmoe-geometry.gguf

clean:
	rm -rf build $(VENV) native/vendor tests/.models
