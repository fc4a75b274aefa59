// Structured output: GBNF grammars for llama.cpp's grammar sampler (Sampler's grammar): llama.cpp's
// own JSON schema converter (common/json-schema-to-grammar, the one behind its --json-schema) and
// its JSON grammar (grammars/json.gbnf).
#include "native.h"

#include "json-gbnf.h"
#include "json-schema-to-grammar.h"

#include <exception>

namespace {

// GBNF accepting the JSON texts the schema (JSON text) describes; ValueError for JSON that is not
// valid or a schema the converter does not support, with its reason.
std::string schema_to_grammar(const std::string & schema) {
    try {
        return json_schema_to_grammar(common_json::parse(schema));
    } catch (const std::exception & e) {
        throw nb::value_error(e.what());
    }
}

}  // namespace

void register_grammar(nb::module_ & m) {
    m.def("json_schema_to_grammar", &schema_to_grammar, nb::arg("schema"),
          "GBNF for the JSON texts a JSON schema (given as JSON text) describes: llama.cpp's converter.");
    m.attr("JSON_GRAMMAR") = JSON_GBNF;
}
