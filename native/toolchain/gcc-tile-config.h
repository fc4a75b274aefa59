// GCC's _tile_loadconfig (amxtileintrin.h, as GCC 12 has it) tells the compiler that ldtilecfg reads 8
// bytes of its 64-byte tile configuration, so the stores of the rows and columns before it are
// dropped as dead: ggml's AMX kernels (ggml-cpu/amx/mmq.cpp, ggml_tile_config_init) then run with
// unconfigured tiles and fault (SIGILL, SIGSEGV) wherever -march=native enables AMX (Sapphire
// Rapids and later), in stock llama.cpp too. Included before that file (native/CMakeLists.txt;
// the Makefile's build of stock llama-cpp-python): the same instruction, reading the whole of it.
#pragma once
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__cplusplus)
#include <immintrin.h>
#undef _tile_loadconfig
#define _tile_loadconfig(config) __asm__ volatile("ldtilecfg\t%X0" ::"m"(*(const unsigned char(*)[64])(config)))
#endif
