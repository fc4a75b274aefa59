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
constexpr int SLOTS_A_PASS = 4;  // the CPU's pass: about a layer's misses in a decode token (top-8 at 25-50 %)
// written after the slots first timed: more than a CPU's last-level cache, so they are read from memory
constexpr uint64_t COLD_BYTES = 256ull << 20;

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

// the link's rate from where the GPU-centric mode uploads a miss. From the host tier's pinned
// memory (from_pinned): a layer's misses, SLOTS_A_PASS experts with every projection, queued at once
// on the device's own stream, as split queues them and as the loader threads keep several in flight
// (one synchronous copy counted each copy's latency: 36-39 GB/s on an H200 where gpu's uploads ran
// at 45). Else from pageable memory, one projection through a bounce buffer. Overwrites the device
// pool's first slots.
double upload_gbps(const slot_pool & device, ggml_backend_dev_t dev, bool from_pinned) {
    ggml_backend_t stream = from_pinned ? ggml_backend_dev_init(dev, nullptr) : nullptr;
    if (!stream) {
        const int p = largest_projection(device);
        const std::vector<char> zeros(device.shapes()[p].bytes, 0);
        ggml_tensor * slot = device.slot_view((expert_projection) p, 0);
        return zeros.size() / best_seconds([&] { ggml_backend_tensor_set(slot, zeros.data(), 0, zeros.size()); }) / 1e9;
    }
    const int n = std::min(SLOTS_A_PASS, device.n_slots());
    const slot_pool pinned(device.shapes(), n, pinned_or_host(dev), /*repack*/ false);  // zeroed
    const double seconds = best_seconds([&] {
        for (int s = 0; s < n; s++) {
            for (int p = 0; p < PROJ_COUNT; p++) {
                if (!device.shapes()[p].present) continue;
                const auto proj = (expert_projection) p;
                ggml_backend_tensor_set_async(stream, device.slot_view(proj, s), pinned.slot_data(proj, s), 0, device.shapes()[p].bytes);
            }
        }
        ggml_backend_synchronize(stream);
    });
    ggml_backend_free(stream);
    return n * expert_bytes_of(device.shapes()) / seconds / 1e9;
}

// every slot of every projection written with zeros, slot by slot (a host pool's memory may be
// anything, or pages never touched that all read one zero page; zeros time as weights do). A pool
// in a buffer type's memory was zeroed when allocated, but projection by projection: written again
// slot by slot, the slots timed first are the longest out of the caches whichever projection is timed.
void write_every_slot(const slot_pool & pool) {
    const std::vector<char> zeros(pool.shapes()[largest_projection(pool)].bytes, 0);
    for (int s = 0; s < pool.n_slots(); s++) {
        for (int p = 0; p < PROJ_COUNT; p++) {
            if (!pool.shapes()[p].present) continue;
            const auto proj = (expert_projection) p;
            if (void * data = pool.slot_data(proj, s)) memset(data, 0, pool.shapes()[p].bytes);
            else ggml_backend_tensor_set(pool.slot_view(proj, s), zeros.data(), 0, pool.shapes()[p].bytes);
        }
    }
}

// the CPU's pass over a decode token's misses as coop computes them: mul_mat_id over a pool in a
// host tier's layout (buft: null for host memory, repacked where repack), SLOTS_A_PASS experts a
// pass, each pass over slots out of the CPU's caches, as a token's misses are (timed over one slot
// kept hot, an OLMoE expert read 88 GB/s on an H200's host where stock's runs imply about 60).
// The pool takes at most max_bytes (the host tier's budget, allocated after this): a smaller one
// reuses its slots, hotter.
double cpu_gbps(const expert_shapes & shapes, ggml_backend_buffer_type_t buft, bool repack, uint64_t max_bytes, int n_threads) {
    const uint64_t expert_bytes = expert_bytes_of(shapes);
    const uint64_t wanted = std::max<uint64_t>(COLD_BYTES / expert_bytes, (kRepeats + 1) * SLOTS_A_PASS);
    const int n_slots = (int) std::max<uint64_t>(2, std::min(wanted, max_bytes / expert_bytes));
    const slot_pool host(shapes, n_slots, buft, repack);
    write_every_slot(host);  // in the order they are timed: the first are the longest out of the caches
    const int p = largest_projection(host);
    ggml_tensor * pool = host.tensor((expert_projection) p);
    ggml_init_params params = { ggml_tensor_overhead() * 4 + ggml_graph_overhead() + 1024, nullptr, /*no_alloc*/ true };
    ggml_context * ctx = ggml_init(params);
    const int per_pass = std::min(SLOTS_A_PASS, n_slots);
    ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, pool->ne[0], 1, 1);
    ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, per_pass, 1);
    ggml_tensor * y = ggml_mul_mat_id(ctx, pool, x, ids);
    ggml_cgraph * graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, y);
    ggml_backend_t cpu = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(cpu, n_threads);
    ggml_backend_buffer_t buffer = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_cpu_buffer_type());
    double gbps = 0;
    if (buffer) {
        ggml_backend_buffer_clear(buffer, 0);
        int next = 0;  // the next slot: each pass takes slots not read before while there are any
        auto pass = [&] {
            for (int i = 0; i < per_pass; i++) ((int32_t *) ids->data)[i] = next++ % n_slots;
            ggml_backend_graph_compute(cpu, graph);
        };
        pass();  // warm-up: the threads
        gbps = per_pass * host.shapes()[p].bytes / best_seconds(pass) / 1e9;
        ggml_backend_buffer_free(buffer);
    }
    ggml_backend_free(cpu);
    ggml_free(ctx);
    return gbps;
}

// split's share of the misses uploaded: the link's and the CPU's end together
double both_end_together(double upload_gbps, double cpu_gbps) { return upload_gbps / (upload_gbps + cpu_gbps); }

}  // namespace

mode_choice choose_mode(const slot_pool & device, ggml_backend_dev_t dev, uint64_t host_bytes, bool repack, bool split_repacked,
                        int n_threads) {
    mode_choice c;
    char line[256];
    if (host_bytes == 0) {
        c.upload_gbps = upload_gbps(device, dev, /*from_pinned*/ false);
        snprintf(line, sizeof(line), "--mode auto chose gpu: no host tier for the CPU to compute misses from (uploads %.2f GB/s)",
                 c.upload_gbps);
        c.reason = line;
        return c;
    }
    c.upload_gbps = upload_gbps(device, dev, /*from_pinned*/ true);
    c.cpu_gbps = cpu_gbps(device.shapes(), nullptr, repack, host_bytes, n_threads);
    c.cpu_split_gbps = repack && !split_repacked ? cpu_gbps(device.shapes(), pinned_or_host(dev), false, host_bytes, n_threads) : c.cpu_gbps;
    const double alone = std::max(c.upload_gbps, c.cpu_gbps), together = c.upload_gbps + c.cpu_split_gbps;
    c.mode = together > SPLIT_MARGIN * alone ? compute_mode::split
           : c.cpu_gbps > c.upload_gbps ? compute_mode::coop : compute_mode::gpu;
    snprintf(line, sizeof(line), "--mode auto chose %s: uploads %.2f GB/s, the CPU's expert math %.2f GB/s (%.2f over split's layout, %s)",
             name_of(c.mode), c.upload_gbps, c.cpu_gbps, c.cpu_split_gbps, split_repacked ? "repacked" : "pinned");
    c.reason = line;
    if (c.mode == compute_mode::split) {
        c.link_share = both_end_together(c.upload_gbps, c.cpu_split_gbps);
        snprintf(line, sizeof(line), ", uploading %.0f %% of the misses at first, then as each decode layer's times say", 100 * c.link_share);
        c.reason += line;
    }
    return c;
}

double split_share(const expert_options & options, const slot_pool & device, ggml_backend_dev_t dev, uint64_t host_bytes,
                   int n_threads, bool split_repacked, std::string * reason) {
    if (options.mode != compute_mode::split) return 0.0;
    if (options.link_share >= 0) return options.link_share;
    const double upload = upload_gbps(device, dev, /*from_pinned*/ true);
    const double cpu = split_repacked ? cpu_gbps(device.shapes(), nullptr, true, host_bytes, n_threads)
                                      : cpu_gbps(device.shapes(), pinned_or_host(dev), false, host_bytes, n_threads);
    const double share = both_end_together(upload, cpu);
    char line[256];
    snprintf(line, sizeof(line), "--mode split uploads %.0f %% of the misses at first, then as each decode layer's times say: "
             "uploads %.2f GB/s, the CPU's expert math %.2f GB/s (%s)",
             100 * share, upload, cpu, split_repacked ? "repacked" : "pinned");
    *reason = line;
    return share;
}
