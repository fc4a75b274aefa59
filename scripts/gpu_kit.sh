#!/usr/bin/env bash
# make gpu-kit: everything a lent GPU machine needs that is slow to build, built here (docs/gpu.md).
#   build/gpu-kit.tar.xz  <- lib/  shared ggml (CUDA sm_90 + CPU, x86-64-v3), our _native module for
#                                  the device's Python, libgomp
#                            bin/  stock llama.cpp's llama-bench from the unpatched sources, on the same ggml
#                            STAMP the tree's native sources it was built from (scripts/native_stamp.sh)
# Usage: scripts/gpu_kit.sh [--vulkan]   (--vulkan: build/gpu-kit-vulkan.tar.xz, the rehearsal's kit,
#                                        ggml-vulkan for lavapipe). Needs make setup-test (tiny models).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VARIANT=cuda
[ "${1:-}" = --vulkan ] && VARIANT=vulkan
WORK=build/gpu-kit-build/$VARIANT
KIT=$WORK/kit
OUT=build/gpu-kit.tar.xz
[ $VARIANT = vulkan ] && OUT=build/gpu-kit-vulkan.tar.xz
PY312=${PY312:-$HOME/.pyenv/versions/3.12.1/bin/python3}   # the device's Python is 3.12
VENV=build/kit-venv
CUBLAS=$ROOT/build/cuda-deps/nvidia/cu13        # the Makefile's $(CUBLAS): nvidia-cublas from PyPI
CUDA_ARCH=${CUDA_ARCH:-90-real}                 # H100 and H200
# the sources as the build starts: a file edited while it runs is not in the kit, so must not be in its stamp
STAMP=$(scripts/native_stamp.sh)

[ -x $VENV/bin/cmake ] || { $PY312 -m venv $VENV && $VENV/bin/pip install -q nanobind==3.1.0 cmake==4.4.4 ninja==1.13.2; }
CMAKE=$ROOT/$VENV/bin/cmake
python3 native/fetch_llama.py
LAUNCH="-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"
command -v ccache >/dev/null || LAUNCH=
COMMON="-G Ninja -DCMAKE_MAKE_PROGRAM=$ROOT/$VENV/bin/ninja -DCMAKE_BUILD_TYPE=Release $LAUNCH"

# 1. ggml, shared, patched (our patches touch only ggml-cpu's negative ids, which stock never passes),
#    built inside the vendored tree (the sdist cannot build ggml standalone; its patched libllama,
#    which needs our expert-format.h, is built and not used).
#    No -march=native: the device's CPU is not this one.
if [ $VARIANT = cuda ]; then
    BACKEND="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH -DCMAKE_CUDA_COMPILER=/usr/local/cuda-13.0/bin/nvcc
             -DGGML_CUDA_NO_VMM=ON -DCUDA_cublas_LIBRARY=$CUBLAS/lib/libcublas.so.13
             -DCUDA_cublasLt_LIBRARY=$CUBLAS/lib/libcublasLt.so.13 -DCMAKE_CUDA_FLAGS=-I$CUBLAS/include"
    # what links against libggml-cuda must find the libraries it needs (cuBLAS from PyPI, the runtime)
    RPATH_LINK=-Wl,-rpath-link,$CUBLAS/lib:/usr/local/cuda-13.0/lib64
else
    BACKEND="-DGGML_VULKAN=ON -DVulkan_INCLUDE_DIR=$ROOT/native/vendor/vulkan/usr/include"
    RPATH_LINK=
fi
$CMAKE -S native/vendor/llama.cpp -B $WORK/ggml $COMMON $BACKEND -DBUILD_SHARED_LIBS=ON -DGGML_RPC=ON \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_CXX_FLAGS=-I$ROOT/native/src -DCMAKE_INSTALL_PREFIX=$ROOT/$WORK/prefix \
    -DCMAKE_INSTALL_RPATH='$ORIGIN' >/dev/null
$CMAKE --build $WORK/ggml
$CMAKE --install $WORK/ggml >/dev/null

# 2. our module, for the device's Python, on that ggml
$CMAKE -S native -B $WORK/native $COMMON -DPYEDGEMOE_SHARED_GGML=ON -Dggml_DIR=$ROOT/$WORK/prefix/lib/cmake/ggml \
    -DPython_EXECUTABLE=$ROOT/$VENV/bin/python -DCMAKE_SHARED_LINKER_FLAGS="$RPATH_LINK" >/dev/null
$CMAKE --build $WORK/native --target _native

# 3. stock llama.cpp's llama-bench: the pinned sources as the sdist has them (unpatched), on that ggml
STOCK=$WORK/stock-src
if [ ! -e $STOCK/CMakeLists.txt ]; then
    python3 -c "import sys; from pathlib import Path; sys.path.insert(0, 'native'); import fetch_llama as f
f.extract_llama(f.download_sdist(), Path('$STOCK'))"
fi
$CMAKE -S $STOCK -B $WORK/stock $COMMON -DLLAMA_USE_SYSTEM_GGML=ON -Dggml_DIR=$ROOT/$WORK/prefix/lib/cmake/ggml \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_OPENSSL=OFF -DCMAKE_EXE_LINKER_FLAGS="$RPATH_LINK" >/dev/null
$CMAKE --build $WORK/stock --target llama-bench

# 4. the kit: the libraries, llama-bench, the tiny test models (one multi-precision), the vocab files of the benchmark
#    geometries, gguf-py's wheel (the device has the rest of our Python dependencies), the stamp
rm -rf $KIT && mkdir -p $KIT/lib $KIT/bin $KIT/models $KIT/vocab $KIT/wheels
cp -P $WORK/prefix/lib/libggml*.so* $KIT/lib/
cp $WORK/native/_native*.so $KIT/lib/
cp "$(gcc -print-file-name=libgomp.so.1)" $KIT/lib/
cp $WORK/stock/bin/llama-bench $KIT/bin/
strip --strip-unneeded $KIT/lib/*.so* $KIT/bin/llama-bench
families() { .venv/bin/python -c "import sys; sys.path.insert(0, 'scripts'); import tiny_moe; print(*tiny_moe.$1)"; }
for arch in $(families MOE_ARCHITECTURES); do
    cp "$(.venv/bin/python scripts/tiny_moe.py $arch --out $WORK/tiny | tail -1)" $KIT/models/tiny-$arch.gguf
done
# the families from llama.cpp's converter: their correctness is `gpu` at 25 % alone
for arch in $(families LLAMA_CPP_ONLY); do
    cp "$(.venv/bin/python scripts/tiny_moe.py $arch --out $WORK/tiny | tail -1)" $KIT/models/more-$arch.gguf
done
# for mixed precision: a LOW copy of every expert
.venv/bin/python -m pyedgemoe convert $KIT/models/tiny-qwen3_moe.gguf -o $KIT/models/mp-qwen3_moe.gguf --low q4_0 >/dev/null
# for split's host tier in both layouts: Q4_K experts, which the CPU repacks
rm -rf $WORK/q4k && mkdir -p $WORK/q4k
cp "$(.venv/bin/python -c "import sys; from pathlib import Path; sys.path.insert(0, 'scripts'); import tiny_moe
print(tiny_moe.repacking_gguf(Path('$WORK/q4k')))" | tail -1)" $KIT/models/q4k-qwen3_moe.gguf
cp native/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf native/vendor/llama.cpp/models/ggml-vocab-gpt-neox.gguf $KIT/vocab/
python3 -m pip download -q --no-deps --only-binary=:all: gguf==0.19.0 -d $KIT/wheels
echo $STAMP > $KIT/STAMP
tar -cf - -C $KIT . | xz -T2 -6 > $OUT.part && mv $OUT.part $OUT
echo "gpu-kit: $OUT, $(du -b $OUT | cut -f1 | numfmt --to=iec) ($(du -sb $KIT | cut -f1 | numfmt --to=iec) unpacked), stamp $(cat $KIT/STAMP)"
