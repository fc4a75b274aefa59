#include "mode-chooser.h"

#include "host-tier.h"
#include "slot-pool.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

namespace {

constexpr int kRepeats = 3;  // the best of these
// split's two rates together must beat the faster alone by this: its own costs (a wait per layer
// for the uploads, the host's memory shared by the CPU's pass and the link) are not in the rates
constexpr double SPLIT_MARGIN = 1.2;

double best_seconds(const std::function<void()> & fn) {
    double best = 1e30;
    for (int i = 0; i < kRepeats; i++) {
        const auto t0 = std::chrono::steady_clock::now();
        fn();
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return std::max(best, 1e-9);
}

// the largest projection present: the rates of small ones are dominated by fixed costs
int largest_projection(const slot_pool & pool) {
    int best = -1;
    for (int p = 0; p < PROJ_COUNT; p++) {
        if (pool.shapes()[p].present && (best < 0 || pool.shapes()[p].bytes > pool.shapes()[best].bytes)) best = p;
    }
    return best;
}

// from where the GPU-centric mode uploads a miss: the host tier's pinned memory when there is one
// (pageable memory goes through a bounce buffer, slower)
double upload_gbps(const slot_pool & device, const slot_pool * pinned) {
    const int p = largest_projection(device);
    const uint64_t bytes = device.shapes()[p].bytes;
    std::vector<char> zeros(pinned ? 0 : bytes, 0);
    const void * source = pinned ? pinned->slot_data((expert_projection) p, 0) : zeros.data();
    ggml_tensor * slot = device.slot_view((expert_projection) p, 0);
    return bytes / best_seconds([&] { ggml_backend_tensor_set(slot, source, 0, bytes); }) / 1e9;
}

// the CPU's pass over one expert as coop computes it: mul_mat_id over a pool laid out as coop's
// host tier is (host-tier.h), a decode token's one row
double cpu_gbps(const slot_pool & host, int n_threads) {
    const int p = largest_projection(host);
    ggml_tensor * pool = host.tensor((expert_projection) p);
    ggml_init_params params = { ggml_tensor_overhead() * 4 + ggml_graph_overhead() + 1024, nullptr, /*no_alloc*/ true };
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, pool->ne[0], 1, 1);
    ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, 1);  // slot 0
    ggml_tensor * y = ggml_mul_mat_id(ctx, pool, x, ids);
    ggml_cgraph * graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, y);
    ggml_backend_t cpu = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(cpu, n_threads);
    ggml_backend_buffer_t buffer = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_cpu_buffer_type());
    double gbps = 0;
    if (buffer) {
        ggml_backend_buffer_clear(buffer, 0);
        ggml_backend_graph_compute(cpu, graph);  // warm-up
        gbps = host.shapes()[p].bytes / best_seconds([&] { ggml_backend_graph_compute(cpu, graph); }) / 1e9;
        ggml_backend_buffer_free(buffer);
    }
    ggml_backend_free(cpu);
    ggml_free(ctx);
    return gbps;
}

// split's share of the misses uploaded: the link's and the CPU's end together
double both_end_together(double upload_gbps, double cpu_gbps) { return upload_gbps / (upload_gbps + cpu_gbps); }

// slot 0 of every projection zeroed (a host pool's memory may be anything; zeros time as weights do)
void zero_slot0(const slot_pool & pool) {
    for (int p = 0; p < PROJ_COUNT; p++) {
        if (!pool.shapes()[p].present) continue;
        const auto proj = (expert_projection) p;
        const std::vector<char> zeros(pool.shapes()[p].bytes, 0);
        if (void * data = pool.slot_data(proj, 0)) memcpy(data, zeros.data(), zeros.size());
        else ggml_backend_tensor_set(pool.slot_view(proj, 0), zeros.data(), 0, zeros.size());
    }
}

}  // namespace

mode_choice choose_mode(const slot_pool & device, ggml_backend_dev_t dev, bool has_host, bool repack, bool split_repacked,
                        int n_threads) {
    mode_choice c;
    // one expert in each mode's host tier layout (host-tier.h), for the two rates
    char line[256];
    if (!has_host) {
        c.upload_gbps = upload_gbps(device, nullptr);
        snprintf(line, sizeof(line), "--mode auto chose gpu: no host tier for the CPU to compute misses from (uploads %.2f GB/s)",
                 c.upload_gbps);
        c.reason = line;
        return c;
    }
    const slot_pool pinned(device.shapes(), 1, pinned_or_host(dev), /*repack*/ false);  // zeroed
    c.upload_gbps = upload_gbps(device, &pinned);
    const slot_pool cpu_layout(device.shapes(), 1, nullptr, repack);
    zero_slot0(cpu_layout);
    c.cpu_gbps = cpu_gbps(cpu_layout, n_threads);
    c.cpu_split_gbps = repack && !split_repacked ? cpu_gbps(pinned, n_threads) : c.cpu_gbps;
    const double alone = std::max(c.upload_gbps, c.cpu_gbps), together = c.upload_gbps + c.cpu_split_gbps;
    c.mode = together > SPLIT_MARGIN * alone ? compute_mode::split
           : c.cpu_gbps > c.upload_gbps ? compute_mode::coop : compute_mode::gpu;
    snprintf(line, sizeof(line), "--mode auto chose %s: uploads %.2f GB/s, the CPU's expert math %.2f GB/s (%.2f over split's layout, %s)",
             name_of(c.mode), c.upload_gbps, c.cpu_gbps, c.cpu_split_gbps, split_repacked ? "repacked" : "pinned");
    c.reason = line;
    if (c.mode == compute_mode::split) {
        c.link_share = both_end_together(c.upload_gbps, c.cpu_split_gbps);
        snprintf(line, sizeof(line), ", uploading %.0f %% of the misses", 100 * c.link_share);
        c.reason += line;
    }
    return c;
}

double split_share(const expert_options & options, const slot_pool & device, ggml_backend_dev_t dev, int n_threads,
                   bool split_repacked, std::string * reason) {
    if (options.mode != compute_mode::split) return 0.0;
    if (options.link_share >= 0) return options.link_share;
    const slot_pool pinned(device.shapes(), 1, pinned_or_host(dev), /*repack*/ false);  // zeroed
    const slot_pool repacked(device.shapes(), 1, nullptr, split_repacked);
    zero_slot0(repacked);
    const double upload = upload_gbps(device, &pinned), cpu = cpu_gbps(split_repacked ? repacked : pinned, n_threads);
    const double share = both_end_together(upload, cpu);
    char line[256];
    snprintf(line, sizeof(line), "--mode split uploads %.0f %% of the misses: uploads %.2f GB/s, the CPU's expert math %.2f GB/s (%s)",
             100 * share, upload, cpu, split_repacked ? "repacked" : "pinned");
    *reason = line;
    return share;
}
