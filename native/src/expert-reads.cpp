#include "expert-reads.h"

#include <algorithm>
#include <stdexcept>

namespace {

std::vector<std::unique_ptr<expert_store>> stores_of(const std::vector<std::string> & files, expert_io io) {
    std::vector<std::unique_ptr<expert_store>> stores;
    for (const auto & f : files) stores.push_back(std::make_unique<expert_store>(f, io));
    return stores;
}

}  // namespace

expert_reader::expert_reader(const std::vector<std::string> & files, expert_io io, int io_threads)
    : stores_(stores_of(files, io)), loaders_(io_threads) {}

void expert_reader::open_low(const std::vector<std::string> & files, expert_io io) { low_stores_ = stores_of(files, io); }

std::vector<expert_read> expert_reader::reads_of(const moe_layer_layout & l, int expert, expert_precision precision,
                                                 const tier_pools & pools, int slot, const tier_pools * host, int host_slot,
                                                 bool in_host, const tier_pools * host_cpu) const {
    const bool low = precision == expert_precision::low;
    std::vector<expert_read> reads;
    for (int p = 0; p < PROJ_COUNT; p++) {
        if (!l.stacked[p]) continue;
        const uint64_t size = (slot >= 0 ? pools : *host).pool(l.group, precision).shapes()[p].bytes;
        const moe_layer_layout::file_place at = low ? l.low_at[p] : l.high_at[p];
        const expert_store & source = *(low ? low_stores_ : stores_)[at.file];
        const uint64_t offset = at.offset + (uint64_t) expert * size;
        const auto proj = (expert_projection) p;
        // the bytes go into the host slot (if any), else the device slot's memory (host pools) or a
        // staging buffer, and from there through the slot's view (if any: a device slot, or a
        // repacked one, whose view converts the layout)
        void * dst = host_slot >= 0 ? host->pool(l.group, precision).slot_data(proj, host_slot)
                                    : pools.pool(l.group, precision).slot_data(proj, slot);
        ggml_tensor * view = slot >= 0 ? pools.pool(l.group, precision).slot_view(proj, slot)
                                       : host->pool(l.group, precision).slot_view(proj, host_slot);
        if (slot >= 0 && host_slot >= 0 && !dst) throw std::logic_error("a repacked host copy cannot be uploaded");
        ggml_tensor * cpu_view = host_cpu && host_slot >= 0 ? host_cpu->pool(l.group, precision).slot_view(proj, host_slot) : nullptr;
        reads.push_back({ &source, offset, size, dst,
                          std::string(low ? "the LOW copy of " : "") + "expert " + std::to_string(expert) + " of layer " +
                          std::to_string(l.il) + " (" + kExpertProjectionNames[p] + ")",
                          view, cpu_view, in_host, low });
    }
    return reads;
}

expert_reader::~expert_reader() {
    wait_uploads();
    uploads_.close();
    for (auto & [device, stream] : upload_streams_) if (stream) ggml_backend_free(stream);
}

ggml_backend_t expert_reader::upload_stream(ggml_backend_dev_t device) {
    auto it = upload_streams_.find(device);
    if (it == upload_streams_.end()) it = upload_streams_.emplace(device, ggml_backend_dev_init(device, nullptr)).first;
    return it->second;
}

std::string expert_reader::read_all(std::vector<expert_read> reads, expert_layer_stats & st, bool queue_uploads) {
    std::vector<upload_queue::upload> uploads;  // each on its device's stream
    for (expert_read & r : reads) {
        if (!queue_uploads || !r.uploads_from_dst()) continue;
        ggml_backend_t stream = upload_stream(ggml_backend_buft_get_device(ggml_backend_buffer_get_type(r.view->buffer)));
        if (!stream) continue;
        r.queued = true;
        uploads.push_back({ stream, r.view, r.dst, (size_t) r.size });
    }
    // a host-tier hit whose upload is queued below (or that needs none) leaves the loader threads
    // nothing to do: waking them for it cost split about 15 us a layer on an H200 (docs/gpu.md)
    reads.erase(std::remove_if(reads.begin(), reads.end(), [](const expert_read & r) { return r.in_dst && (!r.view || r.queued); }),
                reads.end());
    const loader_threads::read_result r = loaders_.read_all(std::move(reads));
    st.bytes_read += r.moved.bytes_read;
    st.bytes_read_low += r.moved.bytes_read_low;
    st.bytes_uploaded += r.moved.bytes_uploaded;
    st.upload_ms += r.moved.upload_ms;
    st.load_ms += r.ms;
    if (!r.error.empty()) return r.error;
    if (uploads.empty()) return "";
    for (const upload_queue::upload & u : uploads) st.bytes_uploaded += u.size;
    uploads_.push(std::move(uploads));
    if (!in_flight_ && hold_) hold_(true);
    in_flight_ = true;
    handed_at_ = std::chrono::steady_clock::now();
    return "";
}

expert_reader::uploads_arrived expert_reader::wait_uploads() {
    if (!in_flight_) return {};
    uploads_arrived r;
    r.since_handed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - handed_at_).count();
    r.queue_ms = uploads_.finish();
    in_flight_ = false;
    if (hold_) hold_(false);
    return r;
}
