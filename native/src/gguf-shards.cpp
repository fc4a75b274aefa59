#include "gguf-shards.h"

#include "ggml.h"
#include "gguf.h"
#include "llama.h"

#include <stdexcept>

namespace {

// split.no / split.count of a shard (0 / 1 for a whole file); llama.cpp's keys (LLM_KV_SPLIT_*), a
// uint16 each (ggml's getter aborts on another type)
int split_key(const gguf_context * meta, const char * key, int absent, const std::string & path) {
    const int64_t id = gguf_find_key(meta, key);
    if (id < 0) return absent;
    if (gguf_get_kv_type(meta, id) != GGUF_TYPE_UINT16) {
        throw std::runtime_error(path + ": its " + key + " is not a uint16, as llama.cpp's split files have it");
    }
    return (int) gguf_get_val_u16(meta, id);
}

}  // namespace

void gguf_shards::free_meta::operator()(gguf_context * m) const { gguf_free(m); }
void gguf_shards::free_shapes::operator()(ggml_context * s) const { ggml_free(s); }

void gguf_shards::open(const std::string & path) {
    ggml_context * shapes = nullptr;
    gguf_init_params params = { /*no_alloc*/ true, &shapes };
    gguf_context * meta = gguf_init_from_file(path.c_str(), params);
    if (!meta) throw std::runtime_error("cannot read the GGUF header of " + path);
    paths_.push_back(path);
    metas_.emplace_back(meta);
    shapes_.emplace_back(shapes);
}

gguf_shards::gguf_shards(const std::string & path) {
    open(path);
    const int n_split = split_key(first(), "split.count", 1, path);
    if (n_split <= 1) return;
    const int split_no = split_key(first(), "split.no", 0, path);
    if (split_no != 0) {
        throw std::runtime_error(path + " is shard " + std::to_string(split_no + 1) + " of " +
                                 std::to_string(n_split) + " of a split GGUF: give its first shard (-00001-of-...)");
    }
    char prefix[4096], shard[4096];  // llama.cpp numbers shards from 0 here (the names from 1)
    if (llama_split_prefix(prefix, sizeof(prefix), path.c_str(), 0, n_split) == 0) {
        throw std::runtime_error(path + " is the first of " + std::to_string(n_split) + " shards of a split GGUF, but "
                                 "not named as one (NAME-00001-of-" + std::to_string(n_split) + ".gguf, as llama.cpp finds the others)");
    }
    for (int i = 1; i < n_split; i++) {
        llama_split_path(shard, sizeof(shard), prefix, i, n_split);
        try {
            open(shard);
        } catch (const std::runtime_error &) {
            throw std::runtime_error("shard " + std::to_string(i + 1) + " of " + std::to_string(n_split) + " of " + path +
                                     " is missing or not a GGUF: " + shard);
        }
        if (split_key(metas_.back().get(), "split.no", -1, shard) != i) {
            throw std::runtime_error(std::string(shard) + " is not shard " + std::to_string(i + 1) + " of " + path);
        }
    }
}

gguf_tensor_place gguf_shards::find(const std::string & name) const {
    for (size_t i = 0; i < metas_.size(); i++) {
        const gguf_context * m = metas_[i].get();
        const int64_t id = gguf_find_tensor(m, name.c_str());
        if (id >= 0) {
            return { ggml_get_tensor(shapes_[i].get(), name.c_str()), (int) i, gguf_get_data_offset(m) + gguf_get_tensor_offset(m, id) };
        }
    }
    return {};
}
