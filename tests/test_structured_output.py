"""Structured output and log-probabilities, built once in the generation path (SamplingParams'
grammar and json_schema, OpenAI's response_format; Generation's logprobs) and so the same through
every way in: the Engine, the batcher (Engine(n_parallel=N)), the server and the CLI.

A constrained text must parse and match its schema whatever the model likes: the checks below are
on the demo model greedy and sampled, with schemas whose every field is bounded, so that the
grammar, not max_tokens, ends the text."""
from __future__ import annotations

import json
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
])
def test_a_bad_grammar_or_schema_is_an_invalid_option_naming_it(eng, kwargs, message):
    with pytest.raises(InvalidOptionError, match=message):
        eng.generate("x = ", 4, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("kwargs", [{"grammar": "root ::= [5-1]"},
                                    {"json_schema": {"type": "integer", "minimum": 5, "maximum": 1}}])
def test_a_grammar_nothing_satisfies_is_an_invalid_option_and_the_engine_goes_on(eng, kwargs, temperature):
    # greedy, llama.cpp's grammar aborted the process on the end of generation it then took
    with pytest.raises(InvalidOptionError, match="no token is allowed here"):
        eng.generate("x = ", 4, temperature=temperature, seed=1, **kwargs)
    assert eng.generate("Answer: ", 4, grammar=YES_NO, temperature=0) in ("yes.", "no.")


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


@pytest.mark.parametrize("args, message", [
    (["--grammar", "root ::= foo"], "error: grammar: error parsing grammar: Undefined rule identifier 'foo'"),
    (["-j", '{"type": "foo"}'], "error: json_schema: JSON schema conversion failed"),
])
def test_serve_refuses_a_bad_default_grammar_or_schema_at_start(args, message):
    # it served, and refused every request naming a grammar the client never sent
    r = subprocess.run([sys.executable, "-m", "pyedgemoe", "serve", str(DEMO), "-t", "1", "--port", "0", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.splitlines()[-1].startswith(message), r.stderr
