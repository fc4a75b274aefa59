"""Structured output and log-probabilities, built once in the generation path (SamplingParams'
grammar and json_schema, OpenAI's response_format; Generation's logprobs) and so the same through
every way in: the Engine, the batcher (Engine(n_parallel=N)), the server and the CLI.

A constrained text must parse and match its schema whatever the model likes: the checks below are
on the demo model greedy and sampled, with schemas whose every field is bounded, so that the
grammar, not max_tokens, ends the text."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from pyedgemoe import Engine, InvalidOptionError, _native
from pyedgemoe.generation import SamplingParams
from pyedgemoe.structured_output import JSON_GRAMMAR
from conftest import in_process_server

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"
SMALL = {"n_ctx": 512, "n_threads": 2}
YES_NO = 'root ::= ("yes" | "no") "."'
# every field bounded: a text of it always ends, in few tokens
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "year", "ok", "colour", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                         "ok": {"type": "boolean"},
                         "colour": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}}}
MESSAGES = [{"role": "system", "content": "You are a helpful assistant that outputs in JSON."},
            {"role": "user", "content": "Who won the world series in 2020"}]


def assert_matches_schema(text: str) -> None:
    """text is JSON of SCHEMA (checked field by field)."""
    value = json.loads(text)
    assert set(value) == set(SCHEMA["required"])
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert type(value["year"]) is int and 1900 <= value["year"] <= 2100
    assert type(value["ok"]) is bool and value["colour"] in ("red", "green", "blue")
    assert len(value["tags"]) <= 2 and all(isinstance(t, str) and len(t) <= 4 for t in value["tags"])


@pytest.fixture(scope="module")
def eng():
    with Engine(DEMO, **SMALL) as eng:
        yield eng


# -- the Engine ---------------------------------------------------------------------------------
def test_a_gbnf_grammar_constrains_the_text(eng):
    answers = {eng.generate("x = ", 8, grammar=YES_NO, temperature=2.0, seed=seed) for seed in range(8)}
    assert answers == {"yes.", "no."}
    assert eng.generate("x = ", 8, grammar=YES_NO, temperature=0) in answers


def test_json_object_gives_a_json_object(eng):
    text = eng.generate("x = ", 64, response_format={"type": "json_object"}, temperature=0)
    assert isinstance(json.loads(text), dict)
    assert eng.generate("x = ", 64, grammar=JSON_GRAMMAR, temperature=0) == text  # llama.cpp's json.gbnf


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_json_schema_gives_json_of_the_schema(eng, temperature):
    for seed in range(3):
        text = eng.generate("x = ", 200, json_schema=SCHEMA, temperature=temperature, seed=seed)
        assert_matches_schema(text)
    assert eng.generate("x = ", 200, json_schema=json.dumps(SCHEMA), temperature=0) == \
        eng.generate("x = ", 200, json_schema=SCHEMA, temperature=0)  # the schema as JSON text or a dict


# each was any string (llama.cpp's converter has no \d, \w, \s, and takes a pattern anchored at both
# ends only), or let the text break the JSON (the dot and a negated class took a raw quote)
@pytest.mark.parametrize("pattern", ["^\\d{3}-\\w{2}$", "^[\\d.]{4}$", "^.{6}$", "^[^a]{5}$", "^\\S{2}\\s\\D\\W$",
                                     "\\d{2}", "^ab\\d", "\\d$"])
def test_a_strings_pattern_is_followed_as_json_schema_reads_it(eng, pattern):
    # the quote ends the text as soon as the pattern lets it; digits are liked, so that one comes soon
    bias = {eng.tokenize('"', add_bos=False)[0]: 30.0, **{eng.tokenize(str(d), add_bos=False)[0]: 10.0 for d in range(10)}}
    for seed in range(3):
        text = eng.generate("x = ", 48, json_schema={"type": "string", "pattern": pattern}, temperature=1.0, seed=seed,
                            logit_bias=bias)
        assert re.search(pattern, json.loads(text), re.ASCII), (pattern, text)


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": SCHEMA}},  # OpenAI's
    {"type": "json_object", "schema": SCHEMA},  # llama-cpp-python's JSON schema mode
])
def test_a_chat_completions_response_format_gives_json_of_its_schema(eng, response_format):
    out = eng.create_chat_completion(MESSAGES, 200, temperature=0, response_format=response_format)
    assert out["choices"][0]["finish_reason"] == "stop"
    assert_matches_schema(out["choices"][0]["message"]["content"])


@pytest.mark.parametrize("spec", [{"name": "a"}, {"name": "a", "schema": {}}])
def test_a_json_schema_response_format_without_a_schema_is_any_object(eng, spec):
    # as llama-server takes it; it gave bare numbers and strings
    for seed in range(4):
        out = eng.create_chat_completion(MESSAGES, 30, temperature=1.0, seed=seed,
                                         response_format={"type": "json_schema", "json_schema": spec})
        assert out["choices"][0]["message"]["content"].lstrip().startswith("{"), out


def test_response_format_text_constrains_nothing(eng):
    assert eng.create_chat_completion(MESSAGES, 12, temperature=0, response_format={"type": "text"})["choices"] == \
        eng.create_chat_completion(MESSAGES, 12, temperature=0)["choices"]


@pytest.mark.parametrize("kwargs, message", [
    ({"grammar": 'root ::= "a" rest'}, "grammar: error parsing grammar: Undefined rule identifier 'rest'"),
    ({"grammar": 'start ::= "a"'}, "grammar: grammar does not contain a 'root' symbol"),
    ({"json_schema": "{not json"}, "json_schema: .*parse error"),
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}},
     "json_schema: JSON schema conversion failed"),
    # the converter's errors on one line ("; " between them)
    ({"json_schema": {"type": "foo", "properties": {"a": {"type": "bar"}}}},
     r"^json_schema: JSON schema conversion failed: JSON schema error at #: unrecognized type foo$"),
    ({"grammar": YES_NO, "json_schema": SCHEMA}, "either a grammar or a json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format: type must be"),
    ({"grammar": 42}, "grammar must be text"),
    # each hung the process, its memory growing without end (a reversed range wrapped to 1.8e19 copies)
    ({"grammar": 'root ::= "x"{3,1}'}, r"grammar: .*repetition \{3,1\} has its minimum above its maximum"),
    ({"json_schema": {"type": "string", "pattern": "^a{3,1}$"}}, r"json_schema: .*repetition \{3,1\}"),
    ({"json_schema": {"type": "string", "minLength": 3, "maxLength": 1}},
     "json_schema: minLength 3 is above maxLength 1: no value meets both"),
    # the converter wrote a grammar of one item, which the text then followed
    ({"json_schema": {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1}},
     "json_schema: minItems 3 is above maxItems 1"),
    # the converter dropped the bound (any integer), or failed without naming it
    ({"json_schema": {"type": "integer", "minimum": 1e19}},
     "json_schema: an integer's minimum 1e.19 is beyond 64 bits"),
    ({"json_schema": {"type": "integer", "maximum": -1e19}},
     "json_schema: an integer's maximum -1e.19 is beyond 64 bits"),
    # the converter's time grows with the cube of an object's optional properties (1,000: 3.4 s)
    ({"json_schema": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}},
     "json_schema: an object of 300 optional properties, more than 256"),
])
def test_a_bad_grammar_or_schema_is_an_invalid_option_naming_it(eng, kwargs, message):
    with pytest.raises(InvalidOptionError, match=message):
        eng.generate("x = ", 4, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("kwargs", [{"grammar": "root ::= [5-1]"},
                                    {"json_schema": {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}}])
def test_a_grammar_nothing_satisfies_is_an_invalid_option_and_the_engine_goes_on(eng, kwargs, temperature):
    # greedy, llama.cpp's grammar aborted the process on the end of generation it then took
    with pytest.raises(InvalidOptionError, match="no token is allowed here"):
        eng.generate("x = ", 4, temperature=temperature, seed=1, **kwargs)
    assert eng.generate("Answer: ", 4, grammar=YES_NO, temperature=0) in ("yes.", "no.")


def ref_chain(n_refs: int, depth: int) -> dict:
    """A schema of n_refs $defs, each an object nested depth levels deep around a $ref of the next."""
    defs = {}
    for i in range(n_refs):
        inner = {"$ref": f"#/$defs/a{i + 1}"} if i + 1 < n_refs else {"type": "integer"}
        for _ in range(depth):
            inner = {"type": "object", "properties": {"p": inner}, "required": ["p"]}
        defs[f"a{i}"] = inner
    return {"$defs": defs, "$ref": "#/$defs/a0"}


@pytest.mark.parametrize("schema, message", [
    (ref_chain(8000, 0), "json_schema: 8000 \\$ref targets, more than 1000"),
    # 1,000 $refs of 30 levels: 30,000 levels of the converter's recursion, on its thread's stack;
    # then a grammar of 61,000 rules, which llama.cpp's parser would recurse through
    (ref_chain(1000, 30), r"json_schema: 6\d{4} rules and parenthesized groups, more than 5000"),
])
def test_a_schema_the_converter_recurses_through_deeply_is_refused_not_a_crash(eng, schema, message):
    # a chain of 8,000 $refs (a body of 290 KB) ended the process: a stack overflow in the converter
    with pytest.raises(InvalidOptionError, match=message):
        eng.generate("x = ", 4, json_schema=schema)


def test_the_schema_converter_leaves_the_gil_to_other_threads(eng):
    """A schema of 250 optional properties takes the converter a tenth of a second: the server's
    other requests (its event loop) go on meanwhile."""
    schema = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(250)}})
    ticks, done = [], threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(1)
            done.wait(0.001)
    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        for _ in range(5):
            _native.json_schema_to_grammar(schema)
    finally:
        done.set()
        ticker.join()
    assert len(ticks) > 20  # with the GIL held throughout: the one tick before the first call


@pytest.mark.parametrize("declared", [("a", "b"), ("items[]", "^")])
def test_other_properties_keys_are_json_strings(eng, declared):
    """Beside the declared properties, a key of additionalProperties: the converter let a raw tab or a
    lone backslash begin it (here, seed 5 wrote one), and took a declared key's "]" or "^" into its
    character classes unescaped (a grammar that did not parse; one that took any character)."""
    schema = {"type": "object", "properties": {key: {"type": "integer"} for key in declared},
              "additionalProperties": {"type": "integer"}}
    pushed = {eng.tokenize(c, add_bos=False)[0]: bias for c, bias in (("\t", 8.0), ('"', 4.0), ("\\", 4.0))}
    stopped = 0
    for seed in range(6):
        out = eng.create_completion("x", max_tokens=48, json_schema=schema, temperature=1.0, seed=seed,
                                    logit_bias=pushed)["choices"][0]
        if out["finish_reason"] == "stop":
            stopped += 1
            assert all(isinstance(v, int) for v in json.loads(out["text"]).values()), out["text"]
    assert stopped >= 2


def test_a_tuple_closed_by_items_false_is_its_prefix_items(eng):
    """Draft 2020-12 closes a tuple with "items": false, which llama.cpp's converter refused."""
    schema = {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": ["a", "b"]}], "items": False}
    for seed in range(3):
        value = json.loads(eng.generate("x = ", 16, json_schema=schema, temperature=1.0, seed=seed))
        assert type(value[0]) is bool and value[1] in ("a", "b") and len(value) == 2


def test_the_json_schema_converter_is_llama_cpps(eng):
    grammar = _native.json_schema_to_grammar(json.dumps({"enum": ["red", "green"]}))
    assert grammar.splitlines()[0] == 'root ::= ("\\"red\\"" | "\\"green\\"")'


# -- log-probabilities --------------------------------------------------------------------------
def test_logprobs_are_the_models_log_softmax(eng):
    prompt = eng.tokenize("def add(a, b):")
    out = eng.create_completion(prompt, 4, temperature=0, logprobs=3)["choices"][0]["logprobs"]
    generated = list(eng.generate_tokens(prompt, 4, SamplingParams(temperature=0)))
    rows = eng.logits(prompt + generated[:-1])[len(prompt) - 1:].astype(np.float64)
    logsoftmax = rows - rows.max(axis=1, keepdims=True)
    logsoftmax -= np.log(np.exp(logsoftmax).sum(axis=1, keepdims=True))
    expected = [logsoftmax[i, t] for i, t in enumerate(generated)]
    # the first from the prompt's batch as here; the others from one-token decodes, which the CPU
    # kernels round differently from this batch of all of them
    assert out["token_logprobs"][0] == pytest.approx(expected[0], abs=1e-5)
    np.testing.assert_allclose(out["token_logprobs"], expected, atol=1e-2)
    for i, top in enumerate(out["top_logprobs"]):
        best = np.argsort(-logsoftmax[i])[:3]
        assert list(top) == [eng.token_piece(int(t)).decode("utf-8", "ignore") for t in best]
    assert out["tokens"] == [eng.token_piece(t).decode() for t in generated]


def test_chat_logprobs_are_openai_shaped(eng):
    out = eng.create_chat_completion(MESSAGES, 5, temperature=0, logprobs=True, top_logprobs=2)["choices"][0]
    assert set(out["logprobs"]) == {"content", "refusal"}
    content = out["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == out["message"]["content"]
    for entry in content:
        assert bytes(entry["bytes"]).decode() == entry["token"] and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] >= entry["logprob"]
    without_top = eng.create_chat_completion(MESSAGES, 5, temperature=0, logprobs=True)["choices"][0]["logprobs"]
    assert [e["top_logprobs"] for e in without_top["content"]] == [[]] * 5
    assert eng.create_chat_completion(MESSAGES, 5, temperature=0)["choices"][0]["logprobs"] is None
    with pytest.raises(InvalidOptionError, match="top_logprobs needs logprobs=True"):
        eng.create_chat_completion(MESSAGES, 5, top_logprobs=2)
    with pytest.raises(InvalidOptionError, match="logprobs must be an integer >= 0"):
        eng.create_completion("x", 2, logprobs=-1)


# -- the batcher --------------------------------------------------------------------------------
def test_the_batcher_constrains_and_scores_each_sequence_as_alone(eng):
    calls = [dict(grammar=YES_NO), dict(json_schema=SCHEMA), dict(response_format={"type": "json_object"}), {}]
    expected = [eng.create_completion("x = ", 200, temperature=0, logprobs=2, **kw)["choices"][0] for kw in calls]
    out: list = [None] * len(calls)
    with Engine(DEMO, n_ctx=2048, n_parallel=4, n_threads=2) as batched:
        start = threading.Barrier(len(calls))

        def one(i: int) -> None:
            start.wait()
            out[i] = batched.create_completion("x = ", 200, temperature=0, logprobs=2, **calls[i])["choices"][0]
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for got, want in zip(out, expected):
        assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        # each sequence's own row (another's would be off by whole units): a decode of a token per
        # sequence rounds differently from one alone, by which sequences share it (up to ~1e-2)
        np.testing.assert_allclose(got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"], atol=5e-2)
    assert out[0]["text"] in ("yes.", "no.")
    assert_matches_schema(out[1]["text"])


# -- the server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(eng):
    with in_process_server(eng, "demo") as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_takes_response_format_grammar_and_logprobs(client, eng, stream):
    def post(path: str, body: dict) -> dict:
        r = client.post(path, json={**body, "stream": stream})
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        return events

    chat = post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 200, "temperature": 0,
                                         "response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "a", "schema": SCHEMA}},
                                         "logprobs": True, "top_logprobs": 2})
    expected = eng.create_chat_completion(MESSAGES, 200, temperature=0, logprobs=True, top_logprobs=2,
                                          response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    if stream:
        content = "".join(e["choices"][0]["delta"].get("content", "") for e in chat)
        entries = [x for e in chat if e["choices"][0]["logprobs"] for x in e["choices"][0]["logprobs"]["content"]]
    else:
        content, entries = chat["choices"][0]["message"]["content"], chat["choices"][0]["logprobs"]["content"]
    assert_matches_schema(content)
    assert content == expected["choices"][0]["message"]["content"]
    assert [e["token"] for e in entries] == [e["token"] for e in expected["choices"][0]["logprobs"]["content"]]

    completion = post("/v1/completions", {"prompt": "x = ", "max_tokens": 8, "temperature": 0, "grammar": YES_NO,
                                          "logprobs": 2})
    choices = [e["choices"][0] for e in completion] if stream else completion["choices"]
    assert "".join(c["text"] for c in choices) in ("yes.", "no.")
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert "".join(tokens) == "".join(c["text"] for c in choices)
    schema = post("/v1/completions", {"prompt": "x = ", "max_tokens": 200, "temperature": 0, "json_schema": SCHEMA})
    assert_matches_schema("".join(c["choices"][0]["text"] for c in (schema if stream else [schema])))


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "grammar": 'root ::= "a" rest'}, "Undefined rule identifier 'rest'"),
    ({"prompt": "x", "grammar": ["root"]}, "'grammar' must be a string"),
    ({"prompt": "x", "json_schema": 3}, "'json_schema' must be a JSON schema"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": "json"}, "'response_format' must be"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"prompt": "x", "logprobs": True}, "'logprobs' must be an integer"),
])
def test_the_server_refuses_a_bad_grammar_schema_or_logprobs_with_a_400(client, body, message):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = client.post(path, json={**body, "max_tokens": 4})
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_a_forced_tools_schema_is_named_as_the_request_names_it(client):
    tools = [{"type": "function", "function": {"name": f, "parameters": p}}
             for f, p in (("ok", {"type": "object"}), ("bad", {"type": "foo"}))]
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "tools": tools,
                                                  "tool_choice": {"type": "function", "function": {"name": "bad"}}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools[1].function.parameters" and "unrecognized type foo" in error["message"], error


@pytest.mark.parametrize("body", [
    {"json_schema": {}},  # llama-server's chat: an empty schema is any object
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],  # OpenAI's arguments: an object
     "tool_choice": {"type": "function", "function": {"name": "f"}}},
])
def test_an_empty_schema_in_a_chat_is_any_object(client, body):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6, "temperature": 1.5,
                                                  "seed": 3, **body})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    text = message["tool_calls"][0]["function"]["arguments"] if "tools" in body else message["content"]
    assert text.startswith("{"), text


# -- the CLI ------------------------------------------------------------------------------------
def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", str(DEMO), "-t", "2", "--temp", "0", *args],
                          capture_output=True, text=True, timeout=300)


def test_the_cli_constrains_with_grammar_and_json_schema_flags_and_files(eng, tmp_path):
    r = run_cli("-p", "x = ", "-n", "8", "--grammar", YES_NO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("x = ") and r.stdout.splitlines()[0][len("x = "):] in ("yes.", "no.")
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "yes_no.gbnf").write_text(YES_NO)
    for flags in (["--json-schema-file", str(tmp_path / "schema.json")], ["--json-schema", json.dumps(SCHEMA)]):
        r = run_cli("-p", "x = ", "-n", "200", *flags)
        assert r.returncode == 0, r.stderr
        text = r.stdout[len("x = "):r.stdout.index("\n\nprompt eval") if "\n\nprompt eval" in r.stdout else None]
        assert text.strip() == eng.generate("x = ", 200, json_schema=SCHEMA, temperature=0).strip()
        assert_matches_schema(text)
    r = run_cli("-p", "x = ", "-n", "8", "--grammar-file", str(tmp_path / "yes_no.gbnf"))
    assert r.returncode == 0 and r.stdout.splitlines()[0][len("x = "):] in ("yes.", "no.")


@pytest.mark.parametrize("args, message", [
    (["--grammar", 'root ::= "a" rest'], "error: grammar: error parsing grammar: Undefined rule identifier 'rest'"),
    (["--json-schema", "{not json"], "error: json_schema:"),
    (["--grammar", YES_NO, "--grammar-file", "/dev/null"], "error: give --grammar or --grammar-file, not both"),
    (["--grammar-file", "/nonexistent.gbnf"], "error: --grammar-file: cannot read /nonexistent.gbnf"),
])
def test_a_bad_grammar_on_the_cli_is_one_error_line(args, message):
    r = run_cli("-p", "x", "-n", "4", *args)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message), r.stderr


def test_an_error_while_generating_ends_the_prompts_line_first():
    """The prompt is shown before it is evaluated; an error found while generating (no token the
    grammar allows) was then written on the prompt's line, in a terminal "xerror: ..."."""
    r = run_cli("-p", "x", "-n", "4", "--grammar", "root ::= [5-1]")
    assert r.returncode == 1 and r.stdout == "x\n", r
    assert r.stderr.splitlines()[-1].startswith("error: no token is allowed here"), r.stderr


@pytest.mark.parametrize("args, message", [
    (["--grammar", "root ::= foo"], "error: grammar: error parsing grammar: Undefined rule identifier 'foo'"),
    (["-j", '{"type": "foo"}'], "error: json_schema: JSON schema conversion failed"),
])
def test_serve_refuses_a_bad_default_grammar_or_schema_at_start(args, message):
    # it served, and refused every request naming a grammar the client never sent
    r = subprocess.run([sys.executable, "-m", "pyedgemoe", "serve", str(DEMO), "-t", "1", "--port", "0", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.splitlines()[-1].startswith(message), r.stderr
