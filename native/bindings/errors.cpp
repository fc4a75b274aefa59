// Routes llama.cpp/ggml log output: silent by default (the CLI prints its own one-line
// errors), everything to stderr when verbose, or through llama.cpp's common log (its verbosity,
// file, colors, prefix and timestamps: the CLI's --log-* flags) once log_to_common is called;
// warnings and errors are remembered so a failed load can say why ("tensor data is not within the
// file bounds", ...).
#include "native.h"

#include "llama.h"
#include "log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <unistd.h>

namespace {
std::mutex g_mutex;
bool g_verbose = false;
bool g_common = false;             // through llama.cpp's common log (log_to_common)
std::deque<std::string> g_recent;  // recent WARN/ERROR lines, bounded
std::string g_partial;             // a line still being assembled (llama logs in pieces)
constexpr size_t kMaxRecent = 16;
thread_local bool t_muted = false;  // log_muted

void log_callback(ggml_log_level level, const char * text, void *) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (t_muted) {
        // only remembered (below)
    } else if (g_common) {
        common_log_default_callback(level, text, nullptr);
    } else if (g_verbose) {
        fputs(text, stderr);
    }
    if (level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN ||
        (level == GGML_LOG_LEVEL_CONT && !g_partial.empty())) {
        g_partial += text;
        size_t nl;
        while ((nl = g_partial.find('\n')) != std::string::npos) {
            std::string line = g_partial.substr(0, nl);
            g_partial.erase(0, nl + 1);
            if (!line.empty()) {
                g_recent.push_back(line);
                if (g_recent.size() > kMaxRecent) g_recent.pop_front();
            }
        }
    }
}
}  // namespace

void log_install() { llama_log_set(log_callback, nullptr); }

log_muted::log_muted() { t_muted = true; }
log_muted::~log_muted() { t_muted = false; }

namespace {
// A GGML_ASSERT / GGML_ABORT in llama.cpp, or an exception nothing caught, leaves a computation
// half done: the process cannot go on. One line says why (ggml's default is its message, a gdb
// backtrace and SIGABRT), and the process exits 1 as the CLI's other errors do.
[[noreturn]] void fatal(const char * why) {
    // several compute threads can hit the same check at once: one reports and exits, the others wait
    static std::atomic<bool> reported{false};
    if (reported.exchange(true)) {
        for (;;) pause();
    }
    fprintf(stderr, "error: llama.cpp stopped on an internal check it cannot recover from: %s\n", why);
    fflush(stderr);
    _exit(1);
}

void on_ggml_abort(const char * message) { fatal(message); }

void on_terminate() {
    try {
        if (auto e = std::current_exception()) std::rethrow_exception(e);
        fatal("std::terminate");
    } catch (const std::exception & ex) {
        fatal(ex.what());
    } catch (...) {
        fatal("an unknown exception");
    }
}
}  // namespace

void abort_install() {
    if (getenv("PYEDGEMOE_NATIVE_BACKTRACE")) return;  // debugging: ggml's message and backtrace
    ggml_set_abort_callback(on_ggml_abort);
    std::set_terminate(on_terminate);
}

void log_set_verbose(bool verbose) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_verbose = verbose;
}

// llama.cpp's common log as its tools set it up (common/arg.cpp's --log-* flags): messages up to
// verbosity (LOG_LEVEL_*: 1 errors ... 5 debug), also written to file ("": none), colors "on", "off"
// or "auto" (on a terminal).
void log_to_common(int verbosity, const std::string & file, const std::string & colors, bool prefix, bool timestamps) {
    std::lock_guard<std::mutex> lock(g_mutex);
    common_log_set_verbosity_thold(verbosity);
    common_log * log = common_log_main();
    if (!file.empty()) common_log_set_file(log, file.c_str());
    common_log_set_colors(log, colors == "on" ? LOG_COLORS_ENABLED : colors == "off" ? LOG_COLORS_DISABLED
                                                                                     : LOG_COLORS_AUTO);
    common_log_set_prefix(log, prefix);
    common_log_set_timestamps(log, timestamps);
    g_common = true;
}

std::string log_recent_errors() {
    std::lock_guard<std::mutex> lock(g_mutex);
    std::string out;
    for (const auto & line : g_recent) {
        if (!out.empty()) out += "\n";
        out += line;
    }
    return out;
}

void log_clear_recent() {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_recent.clear();
    g_partial.clear();
}

// text with each byte that does not belong to a UTF-8 character replaced by U+FFFD: llama.cpp's log
// may quote a damaged file's bytes, and Python's exception message must be text
static std::string as_utf8(const std::string & text) {
    std::string out;
    for (size_t i = 0; i < text.size();) {
        const auto byte = [&](size_t k) { return i + k < text.size() ? (unsigned char) text[i + k] : 0; };
        const unsigned char c = byte(0);
        // a character's bytes (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF)
        const size_t n = c < 0x80 ? 1 : c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
        const unsigned char lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80, hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
        bool whole = n > 0 && (n == 1 || (byte(1) >= lo && byte(1) <= hi));
        for (size_t k = 2; whole && k < n; k++) whole = (byte(k) >> 6) == 0x2;
        out += whole ? text.substr(i, n) : "\xEF\xBF\xBD";
        i += whole ? n : 1;
    }
    return out;
}

void throw_if_remote_lost() {
    const std::string log = log_recent_errors();
    const size_t at = log.find("RPC server ");
    if (at != std::string::npos) throw std::runtime_error(log.substr(at, log.find('\n', at) - at));
}

void throw_with_log(const std::string & what) {
    throw_if_remote_lost();
    std::string detail = log_recent_errors();
    for (size_t at; (at = detail.find('\n')) != std::string::npos;) detail.replace(at, 1, "; ");  // one error line
    throw std::runtime_error(as_utf8(detail.empty() ? what : what + ": " + detail));
}

void register_errors(nb::module_ & m) {
    m.def("set_verbose", &log_set_verbose, nb::arg("verbose"),
          "Forward llama.cpp's log to stderr (off by default).");
    m.def("recent_log_errors", &log_recent_errors);
    m.def("log_to_common", &log_to_common, nb::arg("verbosity"), nb::arg("file"), nb::arg("colors"),
          nb::arg("prefix"), nb::arg("timestamps"),
          "Route llama.cpp's log through its common log, as llama.cpp's tools with their --log-* flags.");
}
