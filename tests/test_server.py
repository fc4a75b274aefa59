"""`pyedgemoe serve` as a client sees it: the real server in a subprocess on a free localhost port,
the demo model behind it with an expert cache of a quarter of its experts, talked to with OpenAI's
own client and with plain HTTP.

The server runs the lossless preset (every expert in HIGH): its greedy answers are then the
model's, whatever the cache holds, and equal to an in-process Engine's with every expert resident
(with LOW precision, a temperature-0 answer depends on the cache, so on the requests before it).
One thread (-t 1): two spinning llama.cpp threads on a shared 2-core machine slow to a crawl."""
from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pyedgemoe import Engine
from server_load import start

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo.gguf"
MODEL_ID = "demo.gguf"
API_KEY = "test-key"
N_CTX = 2048
SERVER_ARGS = ["--expert-cache", "25%", "--system", "lossless", "-t", "1", "-c", str(N_CTX)]
PROMPTS = ["def add(a, b):", "class Node(object):", "import os\n", "# Copyright"]


def start_server(log_path: Path, *args: str, model: Path = DEMO) -> tuple[subprocess.Popen, str]:
    """Starts `pyedgemoe serve` on a free port; returns the process and its base URL once /health answers."""
    proc, url = start(model, log_path, list(args))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if request("GET", url + "/health")[0] == 200:
                return proc, url
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"the server did not answer /health:\n{log_path.read_text()}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def request(method: str, url: str, body: bytes | None = None, key: str | None = API_KEY) -> tuple[int, dict | str]:
    """Plain HTTP: (status, the JSON body, or the text when it is not JSON)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, u.path + (f"?{u.query}" if u.query else ""), body=body, headers=headers)
        response = conn.getresponse()
        text = response.read().decode("utf-8")
    finally:
        conn.close()
    try:
        return response.status, json.loads(text)
    except json.JSONDecodeError:
        return response.status, text


def open_stream(url: str, max_tokens: int, key: str | None = API_KEY) -> tuple[http.client.HTTPConnection, object]:
    """A streamed completion whose first event has been read: it holds the engine."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn.request("POST", "/v1/completions", headers=headers,
                 body=json.dumps({"prompt": "def add(a, b):", "max_tokens": max_tokens, "temperature": 0, "stream": True}))
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    return conn, response


def metric_values(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    status, text = request("GET", url + "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, url = start_server(tmp_path_factory.mktemp("server") / "server.log", *SERVER_ARGS, "--api-key", API_KEY)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    """The same model in this process, every expert resident: what the server must answer (without
    repacked copies, as its expert cache computes)."""
    with Engine(DEMO, n_ctx=N_CTX, n_threads=1, repack=False) as eng:
        yield eng


def solo_answer(client: openai.OpenAI, prompt: str, stream: bool) -> str:
    kwargs = dict(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0)
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    return client.completions.create(**kwargs).choices[0].text


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]


def test_completion_is_the_models_greedy_continuation(client, reference):
    r = client.completions.create(model=MODEL_ID, prompt="def add(a, b):", max_tokens=16, temperature=0)
    expected = reference.create_completion("def add(a, b):", max_tokens=16, temperature=0)
    assert r.choices[0].text == expected["choices"][0]["text"]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (expected["usage"]["prompt_tokens"], 16)
    assert r.model == MODEL_ID


def test_chat_completion_goes_through_the_chat_template(client, reference):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]
    r = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=16, temperature=0)
    expected = reference.create_chat_completion(messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected["choices"][0]["message"]["content"]
    assert r.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    again = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=16, temperature=0)
    # OpenAI's count of the prompt's tokens reused: all but the last, evaluated again for its logits
    assert again.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
    timings = again.model_extra["timings"]  # llama-server's, which its web UI shows
    assert (timings["cache_n"], timings["prompt_n"], timings["predicted_n"]) == \
        (r.usage.prompt_tokens - 1, 1, again.usage.completion_tokens)


def test_llama_servers_paths_without_v1_answer_as_those_with_it(server):
    # clients given the server's address without /v1 (llama-server answers there too)
    body = json.dumps({"messages": [{"role": "user", "content": "def fib(n):"}], "max_tokens": 8,
                       "temperature": 0}).encode()
    for path in ("/chat/completions", "/chat/completions/input_tokens"):
        (status, out), (_, expected) = (request("POST", server + p + path, body) for p in ("", "/v1"))
        assert status == 200 and ("choices" in out or "input_tokens" in out), out
        assert out.get("choices", out) == expected.get("choices", expected)
    body = json.dumps({"input": "def fib(n):"}).encode()
    assert request("POST", server + "/responses/input_tokens", body) == \
        request("POST", server + "/v1/responses/input_tokens", body)


def test_streamed_chat_joins_to_the_non_streamed_text(client):
    kwargs = dict(model=MODEL_ID, messages=[{"role": "user", "content": "def parse(text):"}], max_tokens=32,
                  temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(pieces) > 1
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"


def test_stream_is_server_sent_events_ending_with_done(server):
    body = json.dumps({"model": MODEL_ID, "prompt": "import os\n", "max_tokens": 4, "temperature": 0,
                       "stream": True}).encode()
    status, text = request("POST", server + "/v1/completions", body)
    assert status == 200
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_stop_ends_the_text_before_the_stop_string(client):
    whole = client.completions.create(model=MODEL_ID, prompt="def add(a, b):", max_tokens=24, temperature=0)
    text = whole.choices[0].text
    stop = text.strip()[2:5]  # a few characters the greedy text certainly produces
    cut = client.completions.create(model=MODEL_ID, prompt="def add(a, b):", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=MODEL_ID, prompt="class Node(object):", max_tokens=16, temperature=1.0, top_p=1.0, seed=7,
                  extra_body={"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.1})
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_openais_penalties_and_llama_servers_typical_p_change_the_text(client):
    kwargs = dict(model=MODEL_ID, prompt="def fib(n):", max_tokens=48, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs, frequency_penalty=1.5).choices[0].text != plain
    assert client.completions.create(**kwargs, presence_penalty=1.5).choices[0].text != plain
    sampled = dict(kwargs, temperature=1.0, top_p=1.0, seed=7, extra_body={"top_k": 0, "min_p": 0.0})
    typical = dict(sampled, extra_body={**sampled["extra_body"], "typical_p": 0.5})
    assert client.completions.create(**typical).choices[0].text != client.completions.create(**sampled).choices[0].text


def test_openais_logit_bias_and_llama_cpp_pythons_mirostat_are_the_engines(client, reference):
    kwargs = dict(model=MODEL_ID, prompt="def fib(n):", max_tokens=16, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    first = reference.tokenize(plain.encode(), add_bos=False)[0]
    biased = client.completions.create(**kwargs, logit_bias={str(first): -100}).choices[0].text
    assert biased == reference.create_completion("def fib(n):", max_tokens=16, temperature=0,
                                                 logit_bias={first: -100})["choices"][0]["text"] != plain
    sampled = dict(kwargs, temperature=1.0, seed=7)
    mirostat = client.completions.create(**sampled, extra_body={"mirostat_mode": 2, "mirostat_tau": 3.0}).choices[0]
    assert mirostat.text == reference.create_completion("def fib(n):", max_tokens=16, temperature=1.0, seed=7,
                                                        mirostat_mode=2, mirostat_tau=3.0)["choices"][0]["text"]
    assert mirostat.text != client.completions.create(**sampled).choices[0].text


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_forced_tool_call_is_openais_tool_call_and_the_conversation_goes_on(client):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=MODEL_ID, messages=asked, tools=[WEATHER], max_tokens=48, temperature=0)
    forced = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(**kwargs, tool_choice=forced)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    chunks = list(client.chat.completions.create(**kwargs, tool_choice=forced, stream=True))
    pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the id and the name in the first piece alone, as OpenAI's and llama-server's: the openai package
    # joins every piece's strings (it made "get_weatherget_weather...")
    assert pieces[0].function.name == "get_weather" and all(p.id is None and p.function.name is None for p in pieces[1:])
    with client.chat.completions.stream(**kwargs, tool_choice=forced) as stream:
        joined = stream.get_final_completion().choices[0].message.tool_calls[0]
    assert (joined.function.name, joined.function.arguments) == (call.function.name, call.function.arguments)
    answered = [*asked, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = client.chat.completions.create(model=MODEL_ID, messages=answered, tools=[WEATHER], max_tokens=4,
                                       temperature=0, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content


def test_a_forced_calls_message_goes_back_as_the_openai_package_gives_it(client):
    """The answer of a forced call has the legacy function_call beside tool_calls (llama-cpp-python's):
    OpenAI's tool loop sends it back, as the message object or its model_dump()."""
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    message = client.chat.completions.create(model=MODEL_ID, messages=asked, tools=[WEATHER], tool_choice=forced,
                                             max_tokens=16, temperature=0).choices[0].message
    assert message.function_call is not None
    for sent in (message, message.model_dump(), {**message.model_dump(), "annotations": []}):
        answered = [*asked, sent, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
        r = client.chat.completions.create(model=MODEL_ID, messages=answered, tools=[WEATHER], max_tokens=2,
                                           temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_a_non_streamed_chat_with_tools_has_logprobs_a_stream_none(client, reference):
    """llama-server refuses logprobs only in a stream parsed for calls (its server-common.cpp)."""
    kwargs = dict(messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
                  max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    got = client.chat.completions.create(model=MODEL_ID, **kwargs).choices[0]
    expected = reference.create_chat_completion(**kwargs)["choices"][0]
    assert got.message.content == expected["message"]["content"]
    assert [(t.token, t.logprob) for t in got.logprobs.content] == \
        [(t["token"], pytest.approx(t["logprob"], abs=1e-3)) for t in expected["logprobs"]["content"]]
    assert all(len(t.top_logprobs) == 2 for t in got.logprobs.content)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.chat.completions.create(model=MODEL_ID, **kwargs, stream=True)


def test_openais_legacy_functions_are_a_chats_tools(client):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=MODEL_ID, messages=asked, max_tokens=48, temperature=0)
    legacy = client.chat.completions.create(**kwargs, functions=[WEATHER["function"]],
                                            function_call={"name": "get_weather"}).choices[0]
    forced = client.chat.completions.create(**kwargs, tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert legacy.finish_reason == "tool_calls"
    assert legacy.message.tool_calls[0].function == forced.message.tool_calls[0].function


@pytest.mark.parametrize("extra, param", [
    ({"functions": [WEATHER["function"]], "function_call": 3}, "function_call"),
    ({"functions": [WEATHER["function"]], "tools": [WEATHER]}, "functions"),
    ({"functions": [{"parameters": {}}]}, "functions"),
    ({"functions": [{"name": "f", "parameters": "x"}]}, "functions"),
    ({"functions": [{"name": "f"}], "function_call": {"name": "f", "x": 1}}, "function_call"),
    ({"tools": {"get_weather": WEATHER}}, "tools"),
    ({"tools": [WEATHER], "tool_choice": 3}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": 1}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
])
def test_bad_tools_are_400(server, extra, param):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    status, out = request("POST", server + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, out
    assert out["error"]["param"] == param, out


def test_tokenize_and_detokenize_are_llama_servers(server, reference):
    def post(path: str, body: dict) -> tuple[int, dict]:
        return request("POST", server + path, json.dumps(body).encode())
    text = "def fib(n): héllo ✓"
    ids = reference.tokenize(text, add_bos=False, special=True)
    assert post("/tokenize", {"content": text}) == (200, {"tokens": ids})
    assert post("/tokenize", {"content": text, "add_special": True})[1]["tokens"] == \
        reference.tokenize(text, add_bos=True, special=True)
    status, out = post("/tokenize", {"content": text, "with_pieces": True})
    assert [p["id"] for p in out["tokens"]] == ids
    assert b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode()
                    for p in out["tokens"]).decode() == text  # a split character's pieces as its bytes
    assert post("/detokenize", {"tokens": ids}) == (200, {"content": text})
    for path, body, param in (("/tokenize", {"text": text}, "text"), ("/tokenize", {}, "content"),
                              ("/tokenize", {"content": 3}, "content"), ("/detokenize", {"tokens": [1.5]}, "tokens"),
                              ("/detokenize", {"tokens": [99999]}, None)):
        status, out = post(path, body)
        assert status == 400 and out["error"]["param"] == param, (path, body, out)


def test_llama_cpp_python_servers_extras_tokenize_and_detokenize(server, reference):
    def post(path: str, body: dict) -> tuple[int, dict]:
        return request("POST", server + path, json.dumps(body).encode())
    text = "def fib(n): héllo ✓<|im_start|>"
    ids = reference.tokenize(text, add_bos=True, special=True)  # llama-cpp-python's Llama.tokenize(special=True)
    assert post("/extras/tokenize", {"input": text, "model": MODEL_ID}) == (200, {"tokens": ids})
    assert post("/extras/tokenize/count", {"input": text}) == (200, {"count": len(ids)})
    assert post("/extras/detokenize", {"tokens": ids[1:4]}) == \
        (200, {"text": reference.detokenize(ids[1:4])})
    for path, body, param in (("/extras/tokenize", {"content": text}, "content"),
                              ("/extras/tokenize/count", {"input": 3}, "input"),
                              ("/extras/tokenize", {"input": "x", "model": "other"}, "model"),
                              ("/extras/detokenize", {"tokens": "x"}, "tokens")):
        status, out = post(path, body)
        assert status in (400, 404) and out["error"]["param"] == param, (path, body, out)


def test_seed_minus_one_is_a_random_one_as_in_llama_cpps_server(client):
    kwargs = dict(model=MODEL_ID, prompt="class Node(object):", max_tokens=24, temperature=1.0, top_p=1.0, seed=-1,
                  extra_body={"top_k": 0, "min_p": 0.0})
    assert client.completions.create(**kwargs).choices[0].text != client.completions.create(**kwargs).choices[0].text


def test_concurrent_clients_each_get_their_solo_answer(client):
    streams = [i % 2 == 0 for i in range(len(PROMPTS))]
    alone = [solo_answer(client, p, s) for p, s in zip(PROMPTS, streams)]
    together: list[str | None] = [None] * len(PROMPTS)
    start = threading.Barrier(len(PROMPTS))

    def one(i: int) -> None:
        start.wait()
        together[i] = solo_answer(client, PROMPTS[i], streams[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == alone


def test_a_client_leaving_mid_stream_stops_its_generation(server, client):
    before = metric_values(server)[("pyedgemoe_generated_tokens_total", ())]
    conn, response = open_stream(server, 1500)
    for _ in range(2):
        assert response.readline() == b"\n"
        assert response.readline().startswith(b"data: ")
    conn.sock.shutdown(2)
    conn.close()

    # the next request gets the engine, and the one left behind stopped far from its 1500 tokens
    r = client.completions.create(model=MODEL_ID, prompt="import os\n", max_tokens=8, temperature=0)
    assert r.usage.completion_tokens == 8
    after = metric_values(server)
    assert after[("pyedgemoe_generated_tokens_total", ())] - before - 8 < 500
    assert after[("pyedgemoe_queue_depth", ())] == 0
    assert after[("pyedgemoe_requests_running", ())] == 0


def queue_one(url: str, client: openai.OpenAI) -> tuple[threading.Thread, list]:
    """A 4-token completion sent from a thread, once it waits in the queue: (the thread, its answer
    list, filled when it ends)."""
    answer = []
    waiting = threading.Thread(target=lambda: answer.append(
        client.completions.create(model=MODEL_ID, prompt="import os\n", max_tokens=4, temperature=0)))
    waiting.start()
    deadline = time.monotonic() + 10
    while metric_values(url)[("pyedgemoe_queue_depth", ())] != 1:
        assert time.monotonic() < deadline, "the request never queued behind the running ones"
        time.sleep(0.05)
    return waiting, answer


def test_requests_queue_behind_the_running_one_and_health_still_answers(server, client):
    conn, _ = open_stream(server, 1500)
    waiting, answer = queue_one(server, client)
    started = time.monotonic()
    assert request("GET", server + "/health", key=None)[1]["queue_depth"] == 1
    assert time.monotonic() - started < 1
    assert metric_values(server)[("pyedgemoe_requests_running", ())] == 1
    assert not answer
    conn.sock.shutdown(2)
    conn.close()
    waiting.join(timeout=60)
    assert answer[0].usage.completion_tokens == 4


def test_a_chat_template_refusing_the_messages_is_400():
    from pyedgemoe.chat_template import render_chat
    from pyedgemoe.errors import InvalidOptionError
    from pyedgemoe.server.openai_errors import from_engine_error

    template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(InvalidOptionError) as refused:
        render_chat(template, [{"role": "user", "content": "hi"}], bos_token="", eos_token="")
    error = from_engine_error(refused.value)
    assert error.status == 400 and "must alternate" in error.message


def test_a_lost_remote_device_is_503():  # the Engine's calls raise it from then on (decoder.Decoder.live)
    from pyedgemoe.errors import RemoteDeviceError
    from pyedgemoe.server.openai_errors import from_engine_error

    error = from_engine_error(RemoteDeviceError("RPC server 127.0.0.1:1: connection lost or timed out"))
    assert error.status == 503 and error.message == "RPC server 127.0.0.1:1: connection lost or timed out"


def test_bad_json_is_400(server):
    status, body = request("POST", server + "/v1/completions", b'{"prompt": "x",')
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_json"


def test_unknown_parameters_are_400_naming_them(server):
    body = json.dumps({"model": MODEL_ID, "prompt": "x", "max_tokens": 2, "temprature": 0.5, "best_of": 3}).encode()
    status, out = request("POST", server + "/v1/completions", body)
    assert status == 400 and out["error"]["code"] == "unknown_parameter"
    assert "temprature" in out["error"]["message"]
    body = json.dumps({"model": MODEL_ID, "prompt": "x", "n": 2}).encode()
    status, out = request("POST", server + "/v1/completions", body)
    assert status == 400 and out["error"]["param"] == "n"


def test_out_of_range_sampling_is_400(client):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL_ID, prompt="x", max_tokens=2, top_p=1.5)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_prompt_longer_than_the_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_ID, prompt="word " * (N_CTX + 100), max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    # and a streamed one is refused before any event
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "word " * (N_CTX + 100)}],
                                       max_tokens=4, stream=True)


@pytest.mark.parametrize("include_usage", [True, False, None])
def test_a_stream_ends_with_its_usage_where_stream_options_ask_as_openais(client, include_usage):
    # OpenAI's and llama-server's: the finish reason's chunk, then the usage alone (no choices) if asked
    options = {} if include_usage is None else {"stream_options": {"include_usage": include_usage}}
    whole = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0, stream=True, **options))
    if include_usage:
        usage = chunks[-1].usage  # its cached tokens: the prompt's, reused from the request before
        assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens) == \
            (whole.usage.prompt_tokens, whole.usage.completion_tokens)
        chunks = chunks[:-1]
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)
    completion = list(client.completions.create(model=MODEL_ID, prompt="def ", max_tokens=3, stream=True,
                                                **options))
    assert (completion[-1].usage is not None and completion[-1].choices == []) == bool(include_usage)


def test_anthropics_x_api_key_header_carries_the_key_as_llama_server_takes_it(server):
    # Claude Code sends ANTHROPIC_API_KEY as X-Api-Key; llama-server reads it where Authorization is absent
    u = urlparse(server)
    for headers, status in (([("X-Api-Key", API_KEY)], 200), ([("X-Api-Key", "wrong")], 401),
                            ([("X-Api-Key", API_KEY), ("Authorization", f"Bearer {API_KEY}")], 200),
                            # a header twice: a proxy may read the first where the server read the last
                            ([("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {API_KEY}")], 401),
                            ([("X-Api-Key", "wrong"), ("X-Api-Key", API_KEY)], 401)):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        try:
            conn.putrequest("GET", "/v1/models")
            for name, value in headers:
                conn.putheader(name, value)
            conn.endheaders()
            response = conn.getresponse()
            response.read()
        finally:
            conn.close()
        assert response.status == status, headers


def test_a_wrong_or_missing_key_is_401_except_on_health(server):
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    for path in ("/v1/models", "/metrics"):
        status, body = request("GET", server + path, key=None)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = request("POST", server + "/v1/completions", json.dumps({"prompt": "x"}).encode(), key="wrong")
    assert status == 401
    for path in ("/health", "/v1/health"):  # llama-server's two
        assert request("GET", server + path, key=None) == (200, {"status": "ok", "model": MODEL_ID, "queue_depth": 0})
        assert request("HEAD", server + path, key=None)[0] == 200  # a probe's `curl -I`
    assert request("GET", server + "/models")[1] == request("GET", server + "/v1/models")[1]


@pytest.mark.parametrize("path", ["/v1/models", "/models", f"/v1/models/{MODEL_ID}", "/metrics", "/metrics/experts",
                                  "/props", "/slots", "/health"])
def test_head_is_answered_as_get_without_the_body(server, path):
    """As llama-server's HTTP layer (cpp-httplib) answers HEAD: the GET's status and headers."""
    u = urlparse(server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request("HEAD", path, headers={"Authorization": f"Bearer {API_KEY}"})
        response = conn.getresponse()
        assert response.status == 200 and response.read() == b""
        assert response.getheader("Content-Type").startswith(("application/json", "text/plain"))
    finally:
        conn.close()
    assert request("HEAD", server + "/v1/completions")[0] == 405  # no GET there


def test_several_keys_and_a_key_file_as_llama_servers(tiny_model, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# the team's keys\nkey-c\n\nkey-d\n")
    proc, url = start_server(tmp_path / "server.log", "-t", "1", "-c", "256", "--api-key", "key-a,key-b",
                             "--api-key-file", str(keys), model=tiny_model("qwen3_moe")[0])
    try:
        for key in ("key-a", "key-b", "key-c", "key-d"):
            assert request("GET", url + "/v1/models", key=key)[0] == 200
        for key in ("key-e", "# the team's keys", "key-a,key-b", None):
            assert request("GET", url + "/v1/models", key=key)[0] == 401
    finally:
        stop_server(proc)
    for args, message in ((["--api-key", " , "], "no key"), (["--api-key-file", str(tmp_path / "none.txt")],
                                                               "cannot read --api-key-file")):
        out = subprocess.run([sys.executable, "-m", "pyedgemoe", "serve", str(tiny_model("qwen3_moe")[0]), "--port", "0",
                              *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith("error:") and \
            message in out.stderr, out.stderr


def test_metrics_are_prometheus_text_with_the_expert_cache(server, client):
    client.completions.create(model=MODEL_ID, prompt="def add(a, b):", max_tokens=4, temperature=0)
    m = metric_values(server)
    assert m[("pyedgemoe_requests_total", (("code", "200"), ("path", "/v1/completions")))] >= 1
    assert m[("pyedgemoe_generated_tokens_total", ())] >= 4
    assert m[("pyedgemoe_decode_tokens_per_second", ())] > 0
    hits = {p: m[("pyedgemoe_expert_hits_total", (("precision", p),))] for p in ("high", "low")}
    misses = {p: m[("pyedgemoe_expert_misses_total", (("precision", p),))] for p in ("high", "low")}
    assert hits["high"] > 0 and misses["high"] > 0
    assert hits["low"] == misses["low"] == 0  # lossless: LOW copies are never used
    assert m[("pyedgemoe_expert_requests_total", ())] == sum(hits.values()) + sum(misses.values())
    assert m[("pyedgemoe_expert_read_bytes_total", (("precision", "high"), ("source", "demand")))] > 0
    assert m[("pyedgemoe_expert_read_bytes_total", (("precision", "low"), ("source", "demand")))] == 0  # lossless
    # the misses were read on demand: the decode waited for them
    assert m[("pyedgemoe_expert_stall_seconds_total", ())] > 0


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "serve", *map(str, args)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


@pytest.mark.parametrize("args, fragment", [
    ((DEMO, "--port", "70000"), "--port"),
    ((DEMO, "--parallel", "0"), "--parallel"),
    ((REPO / "models" / "missing.gguf", "--port", "0"), "missing.gguf"),
    ((DEMO, "--max-body", "0"), "--max-body"),
    ((DEMO, "--max-body", "lots"), "--max-body"),
    ((DEMO, "--timeout", "0"), "--timeout"),
    ((DEMO, "--max-connections", "0"), "--max-connections"),
])
def test_bad_serve_input_is_one_error_line(args, fragment):
    r = cli(*args)
    assert r.returncode == 1
    lines = [l for l in r.stderr.splitlines() if l.strip() and not l.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], r.stderr


def test_a_port_in_use_is_one_error_line(server):
    r = cli(DEMO, "--port", str(urlparse(server).port))
    assert r.returncode == 1 and r.stderr.startswith("error: cannot listen on"), r.stderr


@pytest.fixture(scope="module")
def parallel_server(tmp_path_factory):
    """--parallel 2: two generations decode together, one llama_decode per step for both."""
    proc, url = start_server(tmp_path_factory.mktemp("parallel") / "server.log", *SERVER_ARGS, "--parallel", "2")
    yield url
    stop_server(proc)


def test_parallel_clients_each_get_their_solo_answer_and_decode_together(parallel_server, client):
    parallel = openai.OpenAI(base_url=parallel_server + "/v1", api_key="none", max_retries=0, timeout=120)
    expected = [solo_answer(client, p, False) for p in PROMPTS]  # the server with one sequence, one at a time
    together: list[str | None] = [None] * len(PROMPTS)
    start = threading.Barrier(len(PROMPTS))
    running = []

    def one(i: int) -> None:
        start.wait()
        together[i] = solo_answer(parallel, PROMPTS[i], stream=i % 2 == 0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        running.append(metric_values(parallel_server)[("pyedgemoe_requests_running", ())])
    assert together == expected
    assert max(running) <= 2


def test_parallel_completions_name_the_slot_each_ran_in(parallel_server):
    # llama-server's id_slot, which POST /slots/N?action=save takes: it was 0 for every request
    body = json.dumps({"prompt": "def add(a, b):", "n_predict": 200, "temperature": 0, "ignore_eos": True}).encode()
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(request("POST", parallel_server + "/completion", body,
                                                                      key=None)[1])) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(a["id_slot"] for a in answers) == [0, 1]


def test_parallel_a_client_leaving_frees_its_sequence_for_the_queue(parallel_server):
    parallel = openai.OpenAI(base_url=parallel_server + "/v1", api_key="none", max_retries=0, timeout=120)
    first = open_stream(parallel_server, 1500, key=None)
    second = open_stream(parallel_server, 1500, key=None)
    waiting, answer = queue_one(parallel_server, parallel)
    assert metric_values(parallel_server)[("pyedgemoe_requests_running", ())] == 2
    first[0].sock.shutdown(2)
    first[0].close()
    waiting.join(timeout=60)
    assert answer[0].usage.completion_tokens == 4
    assert second[1].readline() == b"\n"  # the other stream goes on
    second[0].sock.shutdown(2)
    second[0].close()


def test_stopping_the_server_ends_a_stream_with_an_error_event(tmp_path):
    proc, url = start_server(tmp_path / "server.log", *SERVER_ARGS)
    conn, response = open_stream(url, 1500, key=None)
    stopped = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    events = [line for line in response.read().decode().split("\n") if line]
    assert proc.wait(timeout=30) == 0  # stopped as asked, as llama-server
    assert time.monotonic() - stopped < 5  # not uvicorn's graceful timeout: the generation ended
    assert json.loads(events[-1][len("data: "):])["error"]["code"] == "server_shutting_down"
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def test_the_pages_need_no_key_and_the_expert_cache_json_does(server):
    for path in ("/", "/experts"):
        status, page = request("GET", server + path, key=None)
        assert status == 200 and "expert cache" in page
    assert request("GET", server + "/metrics/experts", key=None)[0] == 401


def test_metrics_experts_is_the_expert_cache_of_metrics_in_json(server, client):
    client.completions.create(model=MODEL_ID, prompt="import os\n", max_tokens=4, temperature=0)
    status, view = request("GET", server + "/metrics/experts")
    m = metric_values(server)
    assert status == 200 and view["model"] == MODEL_ID
    cache = view["cache"]
    assert len(cache["layers"]) == 6 and cache["experts"] == 6 * 16
    hits = sum(m[("pyedgemoe_expert_hits_total", (("precision", p),))] for p in ("high", "low"))
    assert sum(layer["hits"] for layer in cache["layers"]) >= hits  # a scrape after /metrics' one
    assert cache["hit_rate"] == pytest.approx(sum(l["hits"] for l in cache["layers"])
                                              / sum(l["requests"] for l in cache["layers"]))
    assert cache["precision"]["low"] == 0 and cache["read_bytes"]["demand"]["low"] == 0  # lossless
    assert set(cache["prefetch"]) == {"issued", "used", "wasted", "use_rate"}


def test_props_and_slots_answer_as_llama_server_does(server):
    status, props = request("GET", server + "/props")
    assert status == 200 and props["total_slots"] == 1 and props["model_alias"] == MODEL_ID
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == N_CTX and settings["params"]["temperature"] == 0.2  # the chat's default
    assert settings["params"]["n_predict"] == -1
    assert settings["params"]["frequency_penalty"] == settings["params"]["presence_penalty"] == 0.0
    from pyedgemoe.chat_template import CHATML
    assert props["chat_template"] == CHATML  # the demo model has none: the one in use, as llama-server's
    assert request("GET", server + "/slots") == (200, [{"id": 0, "n_ctx": N_CTX, "is_processing": False}])


def test_a_chat_as_llama_cpp_s_ui_sends_it_is_answered(server):
    """llama.cpp's web UI sends llama-server's options beside OpenAI's: its streaming hints are
    accepted (and change nothing), n_predict is max_tokens, -1 for no limit, return_progress streams
    the prompt's evaluation (prompt_progress) before the text, and timings_per_token gives each chunk
    after the first, of the progress and of the text, the timings so far (the UI's live speed)."""
    body = {"messages": [{"role": "user", "content": "def fib(n):"}], "stream": True, "n_predict": 6,
            "timings_per_token": True, "return_progress": True, "sse_ping_interval": 1, "reasoning_format": "auto",
            "reasoning_control": True, "backend_sampling": False, "temperature": 0.2, "top_k": 40, "top_p": 0.95,
            "min_p": 0.05, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "chat_template_kwargs": {"enable_thinking": False}}
    status, text = request("POST", server + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200
    events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
    assert "usage" not in events[-1] and events[-1]["choices"][0]["finish_reason"]  # no include_usage asked
    end = events[-1]["timings"]  # what the UI shows
    assert 0 < end["predicted_n"] <= 6
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert [("prompt_progress" in e) for e in events[:len(progress) + 1]] == [False] + [True] * len(progress)
    assert progress[-1]["processed"] == progress[-1]["total"] == end["prompt_n"] + end["cache_n"]
    text = events[len(progress) + 1:]
    assert "timings" not in events[0] and all("timings" in e for e in events[1:])
    assert [e["timings"]["prompt_n"] for e in events[1:len(progress) + 1]] == \
        [p["processed"] - p["cache"] for p in progress]  # a progress chunk's: the evaluation's so far
    assert [e["timings"]["predicted_n"] for e in text] == sorted(e["timings"]["predicted_n"] for e in text)
    body = {"messages": body["messages"], "max_tokens": -1, "n_predict": 4}
    status, out = request("POST", server + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and out["error"]["param"] == "n_predict"
