"""`pyedgemoe serve --embeddings`: OpenAI's /v1/embeddings (through OpenAI's own client) and
llama-server's /embeddings and /embedding, the real server in a subprocess over the tiny
Qwen3-MoE, its experts in a 50 % cache, two sequences; the vectors are checked against an
in-process Engine's, and the answers' shapes and errors against llama-server's (written out here)."""
from __future__ import annotations

import base64
import http.client
import json
import threading
from urllib.parse import urlparse

import numpy as np
import openai
import pytest

from pyedgemoe import Engine
from pyedgemoe.embeddings import normalized
from test_server import request, start_server, stop_server

ARGS = ["-t", "1", "-c", "512", "-b", "64", "-ub", "32", "--expert-cache", "50%"]
TEXTS = ["hello world", "Building a website can be done in ten simple steps", "x"]


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen3_moe")[0])


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    """Three servers: pooled (--pooling mean, -np 2), unpooled (--embeddings alone), and one without --embeddings."""
    log = tmp_path_factory.mktemp("embeddings")
    started = [start_server(log / "pooled.log", *ARGS, "-np", "2", "--embeddings", "--pooling", "mean", model=model),
               start_server(log / "rows.log", *ARGS, "--embedding", model=model),
               start_server(log / "off.log", *ARGS, model=model)]
    yield [url for _, url in started]
    for proc, _ in started:
        stop_server(proc)


@pytest.fixture(scope="module")
def expected(model):
    """The Engine's vectors (mean pooled, normalized as llama-server does: euclidean) and rows of TEXTS."""
    def of(pooling: str) -> list[np.ndarray]:
        with Engine(model, n_ctx=512, n_threads=1, pooling=pooling) as eng:
            return [eng.embed(eng.tokenize(t, add_bos=True, special=True)) for t in TEXTS]
    return {"mean": [normalized(v, 2)[0] for v in of("mean")], "none": of("none"), "raw": of("mean")}


def post(url: str, path: str, body) -> tuple[int, dict | list]:
    return request("POST", url + path, json.dumps(body).encode(), key=None)


def test_openais_client_gets_a_normalized_vector_per_input(servers, expected):
    client = openai.OpenAI(base_url=servers[0] + "/v1", api_key="none", max_retries=0, timeout=60)
    out = client.embeddings.create(model="qwen3_moe-f32.gguf", input=TEXTS)
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == "qwen3_moe-f32.gguf"
    for d, vector in zip(out.data, expected["mean"]):
        np.testing.assert_allclose(d.embedding, vector, rtol=0, atol=1e-6)
        assert np.linalg.norm(d.embedding) == pytest.approx(1.0, abs=1e-5)
    n_tokens = out.usage.prompt_tokens
    assert n_tokens == out.usage.total_tokens == sum(len(r) for r in expected["none"])
    # the client's default, base64: float32 bytes
    raw = client.embeddings.with_raw_response.create(model="qwen3_moe-f32.gguf", input="hello world",
                                                     encoding_format="base64")
    item = json.loads(raw.text)["data"][0]
    assert item["encoding_format"] == "base64"
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(item["embedding"]), "<f4"),
                                  np.float32(expected["mean"][0]))


def test_llama_servers_own_endpoints_and_inputs(servers, expected, model):
    status, body = post(servers[0], "/embedding", {"content": TEXTS[1], "embd_normalize": -1})
    assert status == 200 and len(body) == 1 and body[0]["index"] == 0
    np.testing.assert_allclose(body[0]["embedding"], [expected["raw"][1]], atol=1e-6)  # [[pooled, unnormalized]]
    with Engine(model, n_ctx=512, n_threads=1, pooling="mean") as eng:
        ids, world = eng.tokenize("hello", add_bos=True, special=True), eng.tokenize(" world", special=True)
        alone, mixed = eng.embed(ids), eng.embed(ids + world)
    status, body = post(servers[0], "/embeddings", {"input": [ids, ["hello", *world]]})  # ids; text and ids mixed
    assert status == 200 and [b["index"] for b in body] == [0, 1]
    np.testing.assert_allclose(body[0]["embedding"][0], normalized(alone, 2)[0], atol=1e-6)
    np.testing.assert_allclose(body[1]["embedding"][0], normalized(mixed, 2)[0], atol=1e-6)
    status, body = post(servers[0], "/embeddings", {"content": [TEXTS[0]], "embd_normalize": 1})
    np.testing.assert_allclose(np.abs(body[0]["embedding"][0]).sum(), 1.0, atol=1e-5)  # taxicab
    # "content" on /v1/embeddings is answered in llama-server's own shape, as there
    status, body = post(servers[0], "/v1/embeddings", {"content": "x"})
    assert status == 200 and isinstance(body, list) and len(body[0]["embedding"]) == 1


def test_without_pooling_a_row_per_token_and_openai_is_refused(servers, expected):
    status, body = post(servers[1], "/embeddings", {"content": TEXTS[1]})
    assert status == 200
    np.testing.assert_allclose(body[0]["embedding"], expected["none"][1], atol=1e-6)  # rows, not normalized
    status, body = post(servers[1], "/v1/embeddings", {"input": "x"})
    assert status == 400 and "Pooling type 'none' is not OAI compatible" in body["error"]["message"]
    assert "--pooling" in body["error"]["message"]


def test_a_server_without_embeddings_says_how_to_start_one(servers):
    for path in ("/v1/embeddings", "/embeddings", "/embedding"):
        status, body = post(servers[2], path, {"input": "x"})
        assert status == 400 and "--embeddings" in body["error"]["message"], body


@pytest.mark.parametrize("body, param, message", [
    ({}, "input", '"input" or "content" must be provided'),
    ({"input": []}, "input", "must not be empty"),
    ({"input": "word " * 60}, "input", "at most n_ubatch 32"),
    ({"input": [[1, 2, 99999]]}, "input", "out of the vocabulary"),
    ({"input": {"text": "x"}}, "input", "'input' must be"),
    ({"input": [["x", [1]]]}, "input", "'input' must be"),
    ({"input": ["x"] * 2049}, "input", "at most 2048"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "one of"),
    ({"input": "x", "embd_normalize": -2}, "embd_normalize", "in [-1"),
    ({"input": "x", "model": "gpt-4"}, "model", "does not exist"),
    ({"input": "x", "dimensions": 8}, "dimensions", "unknown parameter"),
])
def test_bad_requests_are_400s_naming_what(servers, body, param, message):
    status, answer = post(servers[0], "/v1/embeddings", body)
    assert status in (400, 404) and message in answer["error"]["message"], answer
    assert answer["error"]["param"] == param


def test_embeddings_take_turns_with_generations(servers, expected):
    """With -np 2, embeddings run on a free sequence while generations stream on the other."""
    u = urlparse(servers[0])
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "stream": True}))
    stream = conn.getresponse()
    stream.readline()  # the generation is under way
    results = []

    def embed():
        results.append(post(servers[0], "/v1/embeddings", {"input": TEXTS}))
    threads = [threading.Thread(target=embed) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    text = stream.read().decode()
    conn.close()
    assert text.rstrip().endswith("data: [DONE]")
    assert len(results) == 3
    for status, body in results:
        assert status == 200
        for d, vector in zip(body["data"], expected["mean"]):
            np.testing.assert_allclose(d["embedding"], vector, atol=1e-6)
