// Structured output: GBNF grammars for llama.cpp's grammar sampler (Sampler's grammar): llama.cpp's
// own JSON schema converter (common/json-schema-to-grammar, the one behind its --json-schema) and
// its JSON grammar (grammars/json.gbnf).
#include "native.h"

#include "json-gbnf.h"
#include "json-schema-to-grammar.h"

#include <pthread.h>

#include <cstring>
#include <exception>

namespace {

// The converter recurses through a schema's levels and through each $ref it resolves (a chain of
// 8,000 $refs overflowed an 8 MiB stack): it runs on a thread of this stack, reserved, not touched,
// for the schemas pyedgemoe/grammar_limits.py lets through, with room to spare.
constexpr size_t CONVERTER_STACK_BYTES = 256u << 20;

struct conversion {
    const std::string & schema;
    std::string grammar, error;
    bool failed = false;
};

void * convert(void * arg) {
    auto & c = *static_cast<conversion *>(arg);
    try {
        c.grammar = json_schema_to_grammar(common_json::parse(c.schema));
    } catch (const std::exception & e) {
        c.failed = true;
        c.error = e.what();
    }
    return nullptr;
}

// GBNF accepting the JSON texts the schema (JSON text) describes; ValueError for JSON that is not
// valid or a schema the converter does not support, with its reason. Without the GIL: a large
// schema takes seconds.
std::string schema_to_grammar(const std::string & schema) {
    conversion c{schema};
    int started;
    {
        nb::gil_scoped_release released;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, CONVERTER_STACK_BYTES);
        pthread_t thread;
        started = pthread_create(&thread, &attr, convert, &c);
        pthread_attr_destroy(&attr);
        if (started == 0) pthread_join(thread, nullptr);
    }
    if (started != 0) throw std::runtime_error("cannot start the JSON schema converter's thread: " +
                                               std::string(strerror(started)));
    if (c.failed) throw nb::value_error(c.error.c_str());
    return c.grammar;
}

}  // namespace

void register_grammar(nb::module_ & m) {
    m.def("json_schema_to_grammar", &schema_to_grammar, nb::arg("schema"),
          "GBNF for the JSON texts a JSON schema (given as JSON text) describes: llama.cpp's converter.");
    m.attr("JSON_GRAMMAR") = JSON_GBNF;
}
