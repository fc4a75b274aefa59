// The three string helpers of llama.cpp's common/common.cpp that json-schema-to-grammar.cpp calls
// (declared in common.h). common.cpp itself is not built: it needs the rest of llama.cpp's common
// library (logging, sampling, downloads). Same behaviour as common.cpp's.
#include "common.h"

#include <string>
#include <vector>

std::string string_join(const std::vector<std::string> & values, const std::string & separator) {
    std::string out;
    for (size_t i = 0; i < values.size(); ++i) {
        if (i > 0) out += separator;
        out += values[i];
    }
    return out;
}

// The pieces between delimiters, empty ones included ("a,,b" -> "a", "", "b").
std::vector<std::string> string_split(const std::string & str, const std::string & delimiter) {
    std::vector<std::string> parts;
    size_t start = 0;
    for (size_t end; (end = str.find(delimiter, start)) != std::string::npos; start = end + delimiter.size()) {
        parts.push_back(str.substr(start, end - start));
    }
    parts.push_back(str.substr(start));
    return parts;
}

std::string string_repeat(const std::string & str, size_t n) {
    std::string out;
    out.reserve(str.size() * n);
    for (size_t i = 0; i < n; ++i) out += str;
    return out;
}
