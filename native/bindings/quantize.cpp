// quantize / dequantize: ggml's own quantizers (all types, K-quants included; gguf-py has only
// a few), used by the converter. Rows are split across threads.
#include "native.h"

#include "ggml.h"

#include <nanobind/ndarray.h>

#include <cstring>
#include <thread>
#include <vector>

namespace {

using F32Matrix = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Bytes = nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>;
using F32Out = nb::ndarray<nb::numpy, float, nb::ndim<2>>;

ggml_type type_from_name(const std::string & name) {
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char * tn = ggml_type_name((ggml_type) t);
        if (tn && ggml_get_type_traits((ggml_type) t)->blck_size > 0 && name == tn) return (ggml_type) t;
    }
    throw nb::value_error(("unknown ggml type '" + name + "'").c_str());
}

template <typename F>
void parallel_rows(int64_t n_rows, int n_threads, F && work) {
    n_threads = std::max(1, std::min<int>(n_threads, (int) n_rows));
    std::vector<std::thread> threads;
    const int64_t per = (n_rows + n_threads - 1) / n_threads;
    for (int i = 0; i < n_threads; i++) {
        const int64_t first = i * per, last = std::min(n_rows, first + per);
        if (first < last) threads.emplace_back([&work, first, last] { work(first, last); });
    }
    for (auto & t : threads) t.join();
}

Bytes quantize(F32Matrix data, const std::string & type_name, int n_threads) {
    const ggml_type type = type_from_name(type_name);
    const int64_t n_rows = data.shape(0), n_per_row = data.shape(1);
    if (ggml_quantize_requires_imatrix(type)) {
        throw nb::value_error((type_name + " needs an importance matrix, which pyedgemoe does not compute").c_str());
    }
    if (n_per_row % ggml_blck_size(type) != 0) {
        throw nb::value_error(("row length " + std::to_string(n_per_row) + " is not a multiple of " + type_name +
                               "'s block size " + std::to_string(ggml_blck_size(type))).c_str());
    }
    const size_t row_size = ggml_row_size(type, n_per_row);
    uint8_t * out = new uint8_t[row_size * n_rows];
    nb::capsule owner(out, [](void * p) noexcept { delete[] (uint8_t *) p; });
    const float * src = data.data();
    ggml_quantize_init(type);
    {
        gil_released release;
        parallel_rows(n_rows, n_threads, [&](int64_t first, int64_t last) {
            ggml_quantize_chunk(type, src + first * n_per_row, out + first * row_size, 0, last - first, n_per_row, nullptr);
        });
    }
    return Bytes(out, {row_size * (size_t) n_rows}, owner);
}

F32Out dequantize(nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> data,
                  const std::string & type_name, int64_t n_rows, int64_t n_per_row) {
    const ggml_type type = type_from_name(type_name);
    const auto * traits = ggml_get_type_traits(type);
    const size_t row_size = ggml_row_size(type, n_per_row);
    if (data.shape(0) != row_size * (size_t) n_rows) {
        throw nb::value_error("dequantize: byte count does not match the shape and type");
    }
    if (!traits->to_float) throw nb::value_error(("cannot dequantize " + type_name).c_str());
    float * out = new float[n_rows * n_per_row];
    nb::capsule owner(out, [](void * p) noexcept { delete[] (float *) p; });
    for (int64_t r = 0; r < n_rows; r++) {
        traits->to_float(data.data() + r * row_size, out + r * n_per_row, n_per_row);
    }
    return F32Out(out, {(size_t) n_rows, (size_t) n_per_row}, owner);
}

}  // namespace

void register_quantize(nb::module_ & m) {
    m.def("quantize", &quantize, nb::arg("data"), nb::arg("type"), nb::arg("n_threads") = 1,
          "Quantize float32 [rows, row_length] to a ggml type (by name: q8_0, q4_k, ...); returns the raw bytes.");
    m.def("dequantize", &dequantize, nb::arg("data"), nb::arg("type"), nb::arg("n_rows"), nb::arg("n_per_row"));
    m.def("type_size", [](const std::string & name, int64_t n_per_row) {
        return ggml_row_size(type_from_name(name), n_per_row);
    }, nb::arg("type"), nb::arg("n_per_row"), "Bytes of one row of n_per_row elements in that type.");
}
