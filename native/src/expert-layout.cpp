#include "expert-layout.h"

#include "gguf-shards.h"
#include "llama.h"
#include "llama-model.h"

#include <algorithm>
#include <map>
#include <stdexcept>

namespace {

std::string meta_string(const llama_model * model, const std::string & key) {
    char buf[256];
    int32_t n = llama_model_meta_val_str(model, key.c_str(), buf, sizeof(buf));
    return n < 0 ? std::string() : std::string(buf);
}

expert_matrix_shape shape_of(const ggml_tensor * t) {
    expert_matrix_shape s;
    s.present = true; s.type = t->type; s.ne0 = t->ne[0]; s.ne1 = t->ne[1]; s.bytes = t->nb[2];
    return s;
}

}  // namespace

expert_layout::expert_layout(const llama_model * model, const std::string & path, bool want_low, const std::string & low_from,
                             const std::vector<ggml_backend_dev_t> & devices) {
    std::map<int, moe_layer_layout> by_layer;
    std::map<int, std::pair<expert_shapes, expert_shapes>> shapes_of;  // (HIGH, LOW) per il
    {
        gguf_shards dir(path);
        high_files = dir.paths();
        for (const auto & [name, t] : llama_internal_get_tensor_map(model)) {
            has_expert_bias = has_expert_bias || name.find("_exps.bias") != std::string::npos;
            if (name.find("_exps.scale") != std::string::npos) fixed_routing = "per-expert scales (" + name + ")";
            int il; expert_projection proj;
            if (!parse_expert_tensor_name(name, &il, &proj)) continue;
            const gguf_tensor_place at = dir.find(name);
            if (!at.tensor) throw std::runtime_error("expert tensor " + name + " not in the GGUF directory");
            moe_layer_layout & l = by_layer[il];
            l.il = il;
            l.stacked[proj] = t;
            l.high_at[proj] = { at.shard, at.offset };
            shapes_of[il].first[proj] = shape_of(t);
            if (n_expert == 0) n_expert = (int) t->ne[2];
            if (t->ne[2] != n_expert || !ggml_is_contiguous(t)) {
                throw std::runtime_error("expert tensor " + name + " has an unsupported layout");
            }
        }
    }
    if (by_layer.empty()) throw std::runtime_error("the model has no stacked expert tensors: nothing to offload");

    const std::string arch = meta_string(model, "general.architecture");
    n_expert_used = (int) model->hparams.n_expert_used_max();  // llama.cpp's: a metadata override counts
    if (n_expert_used <= 0 || n_expert_used > n_expert) {
        throw std::runtime_error("the model's " + arch + ".expert_used_count is not within 1.." + std::to_string(n_expert));
    }
    if (has_expert_bias) fixed_routing = "expert biases (*_exps.bias), which the FFN adds by expert id";
    if (arch == "llama4") fixed_routing = "llama4 applies its routing weights before the experts, not to their outputs";
    n_layers = by_layer.rbegin()->first + 1;
    for (auto & [il, l] : by_layer) layers.push_back(l);

    // the top-1 selection is always HIGH: with top-1 routing there is nothing to serve in LOW
    has_low = want_low && n_expert_used > 1;
    if (has_low && has_expert_bias) {
        throw std::runtime_error("mixed-precision experts are not supported for models with expert biases "
                                 "(run with low precision off)");
    }
    if (has_low) {
        low_source = low_from.empty() ? path : low_from;
        gguf_shards dir(low_source);
        low_files = dir.paths();
        for (auto & l : layers) {
            for (int p = 0; p < PROJ_COUNT; p++) {
                if (!l.stacked[p]) continue;
                const std::string stem = expert_tensor_stem(l.il, (expert_projection) p);
                const std::string name = stem + (low_from.empty() ? kLowCopySuffix : ".weight");
                const gguf_tensor_place at = dir.find(name);
                const ggml_tensor * t = at.tensor;
                if (!t) throw std::runtime_error("no LOW copy " + name + " in " + low_source);
                const ggml_tensor * high = l.stacked[p];
                if (t->ne[0] != high->ne[0] || t->ne[1] != high->ne[1] || t->ne[2] != high->ne[2]) {
                    throw std::runtime_error("LOW copy " + name + " in " + low_source + " has another shape than " + stem + ".weight");
                }
                l.low_at[p] = { at.shard, at.offset };
                shapes_of[l.il].second[p] = shape_of(t);
            }
        }
    }

    for (auto & l : layers) {
        const auto & [high, low] = shapes_of[l.il];
        const auto on = std::find(devices.begin(), devices.end(), model->dev_layer(l.il));
        const int home = on == devices.end() ? 0 : (int) (on - devices.begin());
        auto same = [&](const expert_group & g) { return g.high == high && g.low == low && g.home == home; };
        auto it = std::find_if(groups.begin(), groups.end(), same);
        l.group = (int) (it - groups.begin());
        if (it == groups.end()) groups.push_back({ high, low, 0, home });
        groups[l.group].n_layers++;
        high_bytes += expert_bytes_of(high) * n_expert;
        low_bytes += expert_bytes_of(low) * n_expert;
    }
}

const moe_layer_layout * expert_layout::layer_at(int il) const {
    auto it = std::lower_bound(layers.begin(), layers.end(), il, [](const moe_layer_layout & l, int i) { return l.il < i; });
    return it != layers.end() && it->il == il ? &*it : nullptr;
}

std::vector<int> expert_layout::moe_layers() const {
    std::vector<int> out;
    for (const auto & l : layers) out.push_back(l.il);
    return out;
}

std::vector<int> expert_layout::group_of_layers() const {
    std::vector<int> out(n_layers, -1);
    for (const auto & l : layers) out[l.il] = l.group;
    return out;
}

std::vector<std::vector<int>> expert_layout::layers_of_groups() const {
    std::vector<std::vector<int>> out(groups.size());
    for (const auto & l : layers) out[l.group].push_back(l.il);
    return out;
}
