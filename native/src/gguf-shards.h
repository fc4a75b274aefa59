// A GGUF as llama.cpp loads it: one file, or the shards of llama.cpp's gguf-split
// (NAME-00001-of-0000N.gguf; the first holds the model's keys, each its own tensors and data),
// found from the first shard's path as llama.cpp's loader finds them. Its tensor directory with
// shapes, across the shards, without reading any tensor data.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct gguf_context;
struct ggml_context;
struct ggml_tensor;

struct gguf_tensor_place {
    const ggml_tensor * tensor = nullptr;  // its type and shape (no data); null where absent
    int shard = 0;                         // index into gguf_shards::paths()
    uint64_t offset = 0;                   // absolute offset of its data in that shard
};

class gguf_shards {
public:
    // Throws std::runtime_error where a file is not a GGUF, path is a shard other than the first,
    // or a shard is missing or not the one its name says.
    explicit gguf_shards(const std::string & path);

    const std::vector<std::string> & paths() const { return paths_; }  // the first first
    const gguf_context * first() const { return metas_[0].get(); }    // the model's keys
    const gguf_context * meta(int shard) const { return metas_[shard].get(); }
    gguf_tensor_place find(const std::string & name) const;

private:
    struct free_meta { void operator()(gguf_context * m) const; };
    struct free_shapes { void operator()(ggml_context * s) const; };
    std::vector<std::string> paths_;
    std::vector<std::unique_ptr<gguf_context, free_meta>> metas_;
    std::vector<std::unique_ptr<ggml_context, free_shapes>> shapes_;
    void open(const std::string & path);
};
