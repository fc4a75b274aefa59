// Tool calls and thoughts the way llama-server takes them: llama.cpp's chat formats (common/chat.cpp).
// From a model's template, the conversation and the tools, common_chat_templates_apply gives the
// prompt, the grammar a call must follow (lazy: from a trigger the model writes on, or from the first
// token where a call is required), the stops and the parser of the model's text; ChatTurn holds them
// and parses the text into content, reasoning and tool calls, whole or, while it streams, as OpenAI's
// deltas.
#include "native.h"

#include "chat.h"
#include "common.h"
#include "llama.h"

#include <nanobind/stl/vector.h>

#include <memory>

#include <random>

namespace {

struct ChatFormat {
    common_chat_templates_ptr templates;
};

struct ChatTurn {
    common_chat_params params;
    common_chat_parser_params parser;
    common_chat_msg last;                  // what the text parsed to so far (diffs; none at first, as llama-server's
                                           // task_result_state: a prompt that opens a thought streams its tag too;
                                           // a message continued, that message)
    std::vector<std::string> call_ids;     // a call keeps the id it was first given
    common_chat_msg continued;             // the message a continuation starts from (none without one)
};

void create_format(ChatFormat * self, const Model & model, const std::string & chat_template) {
    try {
        new (self) ChatFormat{common_chat_templates_init(model.model, chat_template)};
    } catch (const std::exception & e) {
        throw nb::value_error((std::string("the chat template: ") + e.what()).c_str());
    }
}

// llama-server's call ids: 32 random letters and digits.
std::string random_call_id() {
    static const char chars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    static thread_local std::mt19937 rng{std::random_device{}()};
    std::string id(32, ' ');
    for (char & c : id) c = chars[rng() % (sizeof(chars) - 1)];
    return id;
}

// messages and tools: OpenAI's JSON; template_kwargs: a JSON object of the template's variables
// (llama-server's chat_template_kwargs, enable_thinking among them); reasoning_format: llama-server's
// ("none": the thoughts stay in the content; "auto", "deepseek": they are parsed out of it);
// continue_final_message: llama-server's ("": none; "auto", "content", "reasoning_content": the last
// message, the assistant's, is continued: the prompt ends with it, and the text parsed is what
// follows it); add_generation_prompt: llama-server's. ValueError for what llama.cpp's parsers or the
// template refuse.
ChatTurn * apply(const ChatFormat & format, const std::string & messages, const std::string & tools,
                 const std::string & tool_choice, bool parallel_tool_calls, const std::string & template_kwargs,
                 const std::string & reasoning_format, const std::string & continue_final_message,
                 bool add_generation_prompt) {
    auto turn = std::make_unique<ChatTurn>();
    try {
        common_chat_templates_inputs inputs;
        inputs.messages = common_chat_msgs_parse_oaicompat(common_json::parse(messages));
        inputs.tools = common_chat_tools_parse_oaicompat(common_json::parse(tools));
        inputs.tool_choice = common_chat_tool_choice_parse_oaicompat(tool_choice);
        inputs.parallel_tool_calls = parallel_tool_calls;
        const common_json kwargs = common_json::parse(template_kwargs);
        for (const auto & [key, value] : kwargs.items()) inputs.chat_template_kwargs[key] = value.dump();
        if (kwargs.contains("enable_thinking") && kwargs["enable_thinking"].is_boolean()) {
            inputs.enable_thinking = kwargs["enable_thinking"].get<bool>();  // as llama-server reads it
        }
        inputs.reasoning_format = common_reasoning_format_from_name(reasoning_format);
        inputs.add_generation_prompt = add_generation_prompt;
        inputs.continue_final_message = continue_final_message.empty() ? COMMON_CHAT_CONTINUATION_NONE
            : common_chat_continuation_parse(continue_final_message == "auto" ? common_json(true)
                                                                              : common_json(continue_final_message));
        turn->params = common_chat_templates_apply(format.templates.get(), inputs);
        turn->parser = common_chat_parser_params(turn->params);
        turn->parser.reasoning_format = inputs.reasoning_format;
        if (!turn->params.parser.empty()) turn->parser.parser.load(turn->params.parser);
        if (inputs.continue_final_message != COMMON_CHAT_CONTINUATION_NONE) {
            // the message continued is not the answer's (llama-server's task_result_state)
            turn->parser.is_continuation = true;
            turn->last = turn->continued = common_chat_parse("", true, turn->parser);
        }
    } catch (const std::exception & e) {
        throw nb::value_error(e.what());
    }
    return turn.release();
}

// The grammar's triggers as the lazy grammar sampler takes them (common/sampling.cpp's conversion).
std::vector<std::string> trigger_patterns(const ChatTurn & turn) {
    std::vector<std::string> patterns;
    for (const auto & trigger : turn.params.grammar_triggers) {
        switch (trigger.type) {
            case COMMON_GRAMMAR_TRIGGER_TYPE_WORD: patterns.push_back(regex_escape(trigger.value)); break;
            case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN: patterns.push_back(trigger.value); break;
            case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL: {
                const std::string & p = trigger.value;
                patterns.push_back(p.empty() ? "^$" : (p.front() != '^' ? "^" : "") + p + (p.back() != '$' ? "$" : ""));
                break;
            }
            case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN: break;
        }
    }
    return patterns;
}

std::vector<llama_token> trigger_tokens(const ChatTurn & turn) {
    std::vector<llama_token> tokens;
    for (const auto & trigger : turn.params.grammar_triggers) {
        if (trigger.type == COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN) tokens.push_back(trigger.token);
    }
    return tokens;
}

// text parsed: partial while more may come. A whole text that does not follow the format is a
// ValueError (the caller keeps it as content).
common_chat_msg parse(ChatTurn & turn, const std::string & text, bool is_partial) {
    common_chat_msg msg;
    try {
        msg = common_chat_parse(text, is_partial, turn.parser);
    } catch (const std::exception & e) {
        throw nb::value_error(e.what());
    }
    msg.set_tool_call_ids(turn.call_ids, random_call_id);
    return msg;
}

common_json message_json(const common_chat_msg & msg) {
    common_json calls = common_json::array();
    for (const auto & call : msg.tool_calls) {
        calls.push_back({{"id", call.id}, {"name", call.name}, {"arguments", call.arguments}});
    }
    return {{"content", msg.content}, {"reasoning_content", msg.reasoning_content}, {"tool_calls", calls}};
}

// What the text adds to the message since the last call, as OpenAI's stream deltas
// (llama-server's server_chat_msg_diff_to_json_oaicompat).
common_json deltas(ChatTurn & turn, const std::string & text, bool is_partial) {
    common_chat_msg msg = parse(turn, text, is_partial);
    common_json out = common_json::array();
    if (msg.empty()) return out;  // nothing parsed yet (a partial call): keep what was
    for (const auto & diff : common_chat_msg_diff::compute_diffs(turn.last, msg)) {
        common_json delta = common_json::object();
        if (!diff.reasoning_content_delta.empty()) delta["reasoning_content"] = diff.reasoning_content_delta;
        if (!diff.content_delta.empty()) delta["content"] = diff.content_delta;
        if (diff.tool_call_index != std::string::npos) {
            common_json call = {{"index", diff.tool_call_index}};
            if (!diff.tool_call_delta.id.empty()) {
                call["id"] = diff.tool_call_delta.id;
                call["type"] = "function";
            }
            common_json function = common_json::object();
            if (!diff.tool_call_delta.name.empty()) function["name"] = diff.tool_call_delta.name;
            if (!diff.tool_call_delta.arguments.empty()) function["arguments"] = diff.tool_call_delta.arguments;
            if (!function.empty()) call["function"] = function;
            delta["tool_calls"] = common_json::array({call});
        }
        out.push_back(delta);
    }
    turn.last = msg;
    return out;
}

}  // namespace

void register_chat(nb::module_ & m) {
    nb::class_<ChatFormat>(m, "ChatFormat")
        // chat_template: "" for the model's own
        .def("__init__", &create_format, nb::arg("model"), nb::arg("chat_template") = "")
        .def_prop_ro("supports_parallel_tool_calls", [](const ChatFormat & f) {
                 return common_chat_templates_get_caps(f.templates.get())["supports_parallel_tool_calls"];
             })
        // without the GIL: a long conversation or many tools take llama.cpp's template engine a while
        .def("apply", &apply, nb::arg("messages"), nb::arg("tools"), nb::arg("tool_choice"),
             nb::arg("parallel_tool_calls"), nb::arg("template_kwargs") = "{}", nb::arg("reasoning_format") = "none",
             nb::arg("continue_final_message") = "", nb::arg("add_generation_prompt") = true,
             nb::rv_policy::take_ownership, nb::call_guard<gil_released>());
    nb::class_<ChatTurn>(m, "ChatTurn")
        .def_prop_ro("prompt", [](const ChatTurn & t) { return t.params.prompt; })
        .def_prop_ro("format", [](const ChatTurn & t) { return std::string(common_chat_format_name(t.params.format)); })
        .def_prop_ro("grammar", [](const ChatTurn & t) { return t.params.grammar; })
        .def_prop_ro("grammar_lazy", [](const ChatTurn & t) { return t.params.grammar_lazy; })
        .def_prop_ro("trigger_patterns", &trigger_patterns)
        .def_prop_ro("trigger_tokens", &trigger_tokens)
        .def_prop_ro("generation_prompt", [](const ChatTurn & t) { return t.params.generation_prompt; })
        // the tags around a thought, where llama.cpp's analysis of the template found them ("": none)
        .def_prop_ro("thinking_start_tag", [](const ChatTurn & t) { return t.params.thinking_start_tag; })
        .def_prop_ro("thinking_end_tags", [](const ChatTurn & t) { return t.params.thinking_end_tags; })
        .def_prop_ro("preserved_tokens", [](const ChatTurn & t) { return t.params.preserved_tokens; })
        .def_prop_ro("additional_stops", [](const ChatTurn & t) { return t.params.additional_stops; })
        // {"content", "reasoning_content", "tool_calls": [{"id", "name", "arguments"}]} as JSON text
        // the message a continuation starts from (continue_final_message; else none): JSON as parse's
        .def_prop_ro("continued", [](const ChatTurn & t) { return message_json(t.continued).dump(); })
        .def("parse", [](ChatTurn & t, const std::string & text, bool is_partial) {
                 return message_json(parse(t, text, is_partial)).dump();
             }, nb::arg("text"), nb::arg("is_partial"), nb::call_guard<gil_released>())
        // a JSON list of OpenAI's chat stream deltas
        .def("deltas", [](ChatTurn & t, const std::string & text, bool is_partial) {
                 return deltas(t, text, is_partial).dump();
             }, nb::arg("text"), nb::arg("is_partial"), nb::call_guard<gil_released>());
}
