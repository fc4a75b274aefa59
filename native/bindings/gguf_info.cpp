// gguf_info: a GGUF's key/values and tensor directory (name, type, shape, file and offset, bytes),
// across a split GGUF's shards, read with ggml's own GGUF parser without loading any tensor data.
#include "native.h"

#include "ggml.h"
#include "gguf.h"
#include "llama-arch.h"
#include "../src/gguf-shards.h"
#include "../src/slot-pool.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>

namespace {

nb::object kv_value(const gguf_context * g, int64_t i) {
    switch (gguf_get_kv_type(g, i)) {
        case GGUF_TYPE_UINT8:   return nb::int_(gguf_get_val_u8(g, i));
        case GGUF_TYPE_INT8:    return nb::int_(gguf_get_val_i8(g, i));
        case GGUF_TYPE_UINT16:  return nb::int_(gguf_get_val_u16(g, i));
        case GGUF_TYPE_INT16:   return nb::int_(gguf_get_val_i16(g, i));
        case GGUF_TYPE_UINT32:  return nb::int_(gguf_get_val_u32(g, i));
        case GGUF_TYPE_INT32:   return nb::int_(gguf_get_val_i32(g, i));
        case GGUF_TYPE_UINT64:  return nb::int_(gguf_get_val_u64(g, i));
        case GGUF_TYPE_INT64:   return nb::int_(gguf_get_val_i64(g, i));
        case GGUF_TYPE_FLOAT32: return nb::float_(gguf_get_val_f32(g, i));
        case GGUF_TYPE_FLOAT64: return nb::float_(gguf_get_val_f64(g, i));
        case GGUF_TYPE_BOOL:    return nb::bool_(gguf_get_val_bool(g, i));
        case GGUF_TYPE_STRING:  return nb::str(gguf_get_val_str(g, i));
        case GGUF_TYPE_ARRAY: {
            // Arrays (vocabularies, merges) can be huge: report only their length.
            nb::dict d;
            d["array_length"] = gguf_get_arr_n(g, i);
            return d;
        }
        default: return nb::none();
    }
}

nb::dict read_gguf_info(const std::string & path) {
    log_clear_recent();
    std::unique_ptr<gguf_shards> shards;
    try {
        shards = std::make_unique<gguf_shards>(path);
    } catch (const std::runtime_error & e) {
        throw_with_log(e.what());
    }
    const gguf_context * g = shards->first();
    nb::dict kv;
    for (int64_t i = 0; i < gguf_get_n_kv(g); i++) {
        kv[gguf_get_key(g, i)] = kv_value(g, i);
    }
    nb::list tensors;
    for (int s = 0; s < (int) shards->paths().size(); s++) {
        const gguf_context * m = shards->meta(s);
        const size_t data_offset = gguf_get_data_offset(m);
        for (int64_t i = 0; i < gguf_get_n_tensors(m); i++) {
            const int64_t * ne = gguf_get_tensor_ne(m, i);
            nb::list shape;
            for (int d = 0; d < GGML_MAX_DIMS; d++) shape.append(ne[d]);
            const ggml_type type = gguf_get_tensor_type(m, i);
            nb::dict t;
            t["name"] = gguf_get_tensor_name(m, i);
            t["type"] = ggml_type_name(type);
            t["shape"] = shape;  // ggml order (ne0 = row length), padded with 1s to 4 dims
            t["file"] = s;       // index into "files"
            t["offset"] = data_offset + gguf_get_tensor_offset(m, i);
            t["nbytes"] = gguf_get_tensor_size(m, i);
            tensors.append(t);
        }
    }
    nb::list files;
    for (const auto & f : shards->paths()) files.append(f);
    nb::dict out;
    out["version"] = gguf_get_version(g);
    out["alignment"] = gguf_get_alignment(g);
    out["data_offset"] = gguf_get_data_offset(g);
    out["kv"] = kv;
    out["tensors"] = tensors;
    out["files"] = files;  // the GGUF's files: path, or a split GGUF's shards (the first first)
    return out;
}

// cpu_repacks (slot-pool.h) for a tensor as read_gguf_info lists it: its type's name and shape
bool cpu_repacks_tensor(const std::string & type_name, const std::vector<int64_t> & shape) {
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char * name = ggml_type_name((ggml_type) t);
        if (name && type_name == name && ggml_type_size((ggml_type) t) > 0) {
            int64_t ne[3] = { 1, 1, 1 };
            for (size_t d = 0; d < shape.size() && d < 3; d++) ne[d] = shape[d];
            // a shape ggml cannot hold (llama.cpp's loader refuses the file) is not repacked
            if (ne[0] <= 0 || ne[1] <= 0 || ne[2] <= 0 || ne[0] % ggml_blck_size((ggml_type) t) != 0) return false;
            return cpu_repacks((ggml_type) t, ne[0], ne[1], ne[2]);
        }
    }
    throw nb::value_error(("unknown ggml type '" + type_name + "'").c_str());
}

// Whether llama.cpp keeps a state per sequence for the architecture that it cannot cut back to an
// earlier position (recurrent layers, alone or beside attention: llama_model_is_recurrent/_hybrid)
bool architecture_is_recurrent(const std::string & name) {
    const llm_arch arch = llm_arch_from_string(name);
    return llm_arch_is_recurrent(arch) || llm_arch_is_hybrid(arch);
}

}  // namespace

void register_gguf_info(nb::module_ & m) {
    m.def("architecture_is_recurrent", &architecture_is_recurrent, nb::arg("name"),
          "Whether the architecture (general.architecture) has recurrent layers, whose state cannot drop its last tokens.");
    m.def("cpu_repacks", &cpu_repacks_tensor, nb::arg("type"), nb::arg("shape"),
          "Whether llama.cpp's CPU backend keeps a repacked copy of a weight of this type and shape.");
    m.def("read_gguf_info", &read_gguf_info, nb::arg("path"),
          "Key/values and tensor directory of a GGUF (a split one's shards too; no tensor data is read).");
}
