"""`pyedgemoe serve` started as llama-server is in the guides to large MoEs (`--temp 0.6 --top-k 20
--top-p 0.95 --min-p 0 -n 512 --seed 3407`, with `-cb --metrics --no-context-shift --cache-reuse 256`
and the experts kept in RAM by `-ot`): the sampling flags and -n are every request's settings where it
gives none, on every endpoint, and /props shows them (llama.cpp's web UI sends them back); the rest is
taken as pyedgemoe does it, with a note where it does otherwise. The answers are checked against an
in-process Engine with the same settings."""
from __future__ import annotations

import json
import os

import pytest

from pyedgemoe import Engine
from test_server import DEMO, request, start_server, stop_server

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
ARGS = ["-t", "1", "-c", "512", "--temp", "0.7", "--top-k", "5", "--seed", "11", "-n", "6", "-cb", "--metrics",
        "--no-context-shift", "--cache-reuse", "256", "-ot", ".ffn_.*_exps.=CPU", "--prio", "-1"]


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    return tmp_path_factory.mktemp("defaults") / "server.log"


@pytest.fixture(scope="module")
def served(log):
    proc, url = start_server(log, *ARGS, "-j", json.dumps(SCHEMA), "--api-key", "k")
    yield proc, url
    stop_server(proc)


@pytest.fixture(scope="module")
def server(served):
    return served[1]


@pytest.fixture(scope="module")
def engine():
    with Engine(DEMO, n_ctx=512, n_threads=1) as eng:
        yield eng


def post(url: str, path: str, body: dict) -> dict:
    status, out = request("POST", url + path, json.dumps(body).encode(), key="k")
    assert status == 200, out
    return out


def test_a_request_that_gives_no_settings_takes_the_servers(server, engine):
    out = post(server, "/v1/completions", {"prompt": "def fib(n):"})
    expected = engine.generate("def fib(n):", 6, temperature=0.7, top_k=5, seed=11, json_schema=SCHEMA)
    assert out["usage"]["completion_tokens"] == 6 and out["choices"][0]["text"] == expected
    native = post(server, "/completion", {"prompt": "def fib(n):"})
    assert native["tokens_predicted"] == 6 and native["content"] == expected


def test_a_requests_own_settings_win_and_its_own_constraint_replaces_the_default_schema(server, engine):
    out = post(server, "/v1/completions", {"prompt": "def fib(n):", "temperature": 0, "max_tokens": 4,
                                           "grammar": 'root ::= "yes" | "no"'})
    assert out["choices"][0]["text"] in ("yes", "no")
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                                                 "response_format": {"type": "text"}})
    expected = engine.create_chat_completion([{"role": "user", "content": "hi"}], 6, temperature=0, top_k=5,
                                             seed=11)["choices"][0]["message"]["content"]
    assert chat["choices"][0]["message"]["content"] == expected


def test_props_show_the_servers_defaults(server):
    status, props = request("GET", server + "/props", key="k")
    params = props["default_generation_settings"]["params"]
    assert (params["temperature"], params["top_k"], params["n_predict"]) == (0.7, 5, 6)


def test_prio_sets_the_processs_priority_as_llama_cpp(served):
    assert os.getpriority(os.PRIO_PROCESS, served[0].pid) == 5  # low: nice 5


def test_what_is_done_otherwise_is_noted(server, log):
    notes = [line for line in log.read_text().splitlines() if line.startswith("note: ")]
    assert any(line.startswith("note: --cache-reuse 256: not used") for line in notes), notes
    assert any(line.startswith("note: -ot .ffn_.*_exps.=CPU: experts stay in host memory") for line in notes), notes


@pytest.mark.parametrize("args, fragment", [(["--top-p", "2"], "top_p must be in"), (["-n", "-2"], "--n-predict"),
                                            (["--top-k", "x"], "'--top-k'"),
                                            (["--context-shift"], "--context-shift is not supported"),
                                            (["--prio", "7"], "--prio takes -1 (low)"),
                                            (["-rea", "maybe"], "--reasoning takes on, off or auto"),
                                            (["-rea", "on", "--chat-template-kwargs", '{"enable_thinking": false}'],
                                             "gives enable_thinking False, --reasoning or --reasoning-effort True")])
def test_a_bad_default_is_one_error_line_before_the_load(args, fragment):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "pyedgemoe", "serve", str(DEMO), "--port", "0", *args],
                       capture_output=True, text=True, timeout=30)
    lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("note: ")]
    assert r.returncode != 0 and len(lines) == 1 and fragment in lines[0], r.stderr


THINKING = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "thinking={{ enable_thinking | default('unset') }} effort={{ reasoning_effort | default('unset') }}")


@pytest.mark.parametrize("args, shown", [
    ([], "thinking=True effort=unset"), (["-rea", "off"], "thinking=False effort=unset"),
    (["--reasoning", "on", "--reasoning-effort", "high"], "thinking=True effort=high"),
    (["--chat-template-kwargs", '{"enable_thinking": false}', "-rea", "auto"], "thinking=False effort=unset"),
])
def test_reasoning_flags_are_the_templates_variables_as_llama_servers(tmp_path, args, shown):
    proc, url = start_server(tmp_path / "server.log", "-t", "1", "-c", "512", "--chat-template", THINKING, *args)
    try:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        status, out = request("POST", url + "/apply-template", json.dumps(body).encode(), key=None)
        assert status == 200 and out["prompt"].endswith(shown), out
        body["chat_template_kwargs"] = {"enable_thinking": True}  # a request's own win
        assert request("POST", url + "/apply-template", json.dumps(body).encode(), key=None)[1]["prompt"] \
            .startswith("user: hi\nthinking=True")
    finally:
        stop_server(proc)


def test_openais_reasoning_effort_is_the_templates_as_llama_servers(tmp_path):
    """A chat's reasoning_effort (OpenAI's), a response's reasoning.effort: the template's
    reasoning_effort; "none": enable_thinking false."""
    proc, url = start_server(tmp_path / "server.log", "-t", "1", "-c", "512", "--chat-template", THINKING)
    try:
        def applied(extra: dict) -> str:
            body = {"messages": [{"role": "user", "content": "hi"}], **extra}
            status, out = request("POST", url + "/apply-template", json.dumps(body).encode(), key=None)
            assert status == 200, out
            return out["prompt"]
        assert applied({"reasoning_effort": "low"}).endswith("thinking=True effort=low")
        assert applied({"reasoning_effort": "none"}).endswith("thinking=False effort=unset")
        assert applied({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}) \
            .endswith("effort=high")
        status, out = request("POST", url + "/apply-template", json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": 3}).encode(), key=None)
        assert status == 400 and "reasoning_effort" in out["error"]["message"]

        def counted(extra: dict) -> int:
            status, out = request("POST", url + "/v1/responses/input_tokens", json.dumps(
                {"model": "demo.gguf", "input": "hi", **extra}).encode(), key=None)
            assert status == 200, out
            return out["input_tokens"]
        long_level = {"reasoning": {"effort": "thorough, careful and step by step"[:32]}}
        assert counted(long_level) > counted({}) == counted({"reasoning": {"summary": "auto"}})
    finally:
        stop_server(proc)


def test_no_webui_serves_the_api_alone_as_llama_server(tmp_path):
    # no -c: the model's training context (256 positions), as run's default (at most 4096)
    proc, url = start_server(tmp_path / "server.log", "-t", "1", "--no-webui")
    try:
        for page in ("/", "/experts", "/index.html"):
            assert request("GET", url + page, key=None)[0] == 404
        status, props = request("GET", url + "/props", key=None)
        assert status == 200 and props["ui"] is False and props["default_generation_settings"]["n_ctx"] == 256
        assert request("POST", url + "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 1}).encode(),
                       key=None)[0] == 200
    finally:
        stop_server(proc)
