// The names of the multi-precision GGUF format (docs/format.md) that native code reads, defined
// once; pyedgemoe/gguf_format.py defines the same names for Python. Header-only, because the
// llama.cpp patches 0001 and 0003 use it too.
#pragma once

#include <cstdio>
#include <string>

// The projections of a stacked expert tensor: blk.<il>.ffn_<projection>_exps.weight
enum expert_projection { PROJ_UP, PROJ_GATE, PROJ_DOWN, PROJ_GATE_UP, PROJ_COUNT };
inline constexpr const char * kExpertProjectionNames[PROJ_COUNT] = { "up", "gate", "down", "gate_up" };

// A stacked expert tensor's LOW-precision copy: "blk.<il>.ffn_<projection>_exps" + this suffix.
inline constexpr const char * kLowCopySuffix = ".lowbit";

// "blk.<il>.ffn_<projection>_exps" (the stem of the tensor and of its LOW copy)
inline std::string expert_tensor_stem(int il, expert_projection p) {
    return "blk." + std::to_string(il) + ".ffn_" + kExpertProjectionNames[p] + "_exps";
}

// Whether name is a stacked expert tensor ("blk.<il>.ffn_<projection>_exps.weight"), and which.
inline bool parse_expert_tensor_name(const std::string & name, int * il, expert_projection * proj) {
    int layer = -1, used = 0;
    char kind[16] = {0};
    if (sscanf(name.c_str(), "blk.%d.ffn_%15[a-z_]%n", &layer, kind, &used) != 2 || layer < 0) return false;
    for (int p = 0; p < PROJ_COUNT; p++) {
        if (kind == std::string(kExpertProjectionNames[p]) + "_exps" && name.compare(used, std::string::npos, ".weight") == 0) {
            *il = layer; *proj = (expert_projection) p; return true;
        }
    }
    return false;
}

inline bool is_expert_tensor_name(const std::string & name) {
    int il; expert_projection p;
    return parse_expert_tensor_name(name, &il, &p);
}

// Whether name is the LOW copy of a stacked expert tensor (which llama.cpp itself never loads).
inline bool is_low_copy_name(const std::string & name) {
    const std::string suffix = kLowCopySuffix;
    return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}
