"""llama-server's own API on `pyedgemoe serve`: POST /completion (llama-server's README's first
example) and POST /infill (code editors' fill in the middle), the real server in a subprocess, a
tiny Qwen3-MoE behind it whose fill-in-the-middle tokens are given by --override-kv (a code model's
GGUF has them). Answers are checked against an in-process Engine's greedy tokens and against
llama-server's format_prompt_infill, written out here."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import pytest

from pyedgemoe import Engine
from pyedgemoe.generation import SamplingParams
from test_server import DEMO, request, start_server, stop_server

FIM = {"pre": 3, "suf": 4, "mid": 5}
FIM_OVERRIDES = ",".join(f"tokenizer.ggml.fim_{role}_token_id=int:{token}" for role, token in FIM.items())
N_CTX, N_BATCH = 512, 64
ARGS = ["-t", "1", "-c", str(N_CTX), "-b", str(N_BATCH), "-ub", str(N_BATCH), "--expert-cache", "50%"]


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen3_moe")[0])


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    proc, url = start_server(tmp_path_factory.mktemp("llama-api") / "server.log", *ARGS, "--override-kv",
                             FIM_OVERRIDES, model=model)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model, n_ctx=N_CTX, n_threads=1, override_kv=FIM_OVERRIDES) as eng:
        yield eng


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    return request("POST", url + path, json.dumps(body).encode(), key=None)


def events(url: str, path: str, body: dict) -> list[str]:
    """The raw `data:` payloads of a streamed answer, in order."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    text = response.read().decode()
    conn.close()
    assert all(block.startswith("data: ") for block in text.split("\n\n") if block)
    return [block.removeprefix("data: ") for block in text.split("\n\n") if block]


def greedy(engine, tokens: list[int], n: int) -> tuple[str, list[int]]:
    """The greedy continuation's text as llama-server shows it (bytes that are not UTF-8 as U+FFFD,
    which a tiny model's single-byte tokens often are), and its tokens."""
    ids = list(engine.generate_tokens(tokens, n, SamplingParams(temperature=0.0)))
    return b"".join(engine.token_piece(t) for t in ids).decode("utf-8", "replace"), ids


def test_a_completion_is_the_models_greedy_text_with_llama_servers_fields(server, engine):
    status, body = post(server, "/completion", {"prompt": "Building a website can be done in", "n_predict": 12,
                                                "temperature": 0, "return_tokens": True})
    assert status == 200, body
    tokens = engine.tokenize("Building a website can be done in", add_bos=True, special=True)
    text, ids = greedy(engine, tokens, 12)
    assert body["content"] == text and body["tokens"] == ids
    assert body["stop"] is True and body["stop_type"] == "limit" and body["stopping_word"] == ""
    assert body["tokens_predicted"] == 12 and body["tokens_evaluated"] == len(tokens)
    assert body["prompt"] == engine.detokenize(tokens, special=True) and body["truncated"] is False
    assert body["has_new_line"] == ("\n" in text) and body["model"] == "qwen3_moe-f32.gguf"
    assert body["generation_settings"]["n_predict"] == 12 and body["generation_settings"]["temperature"] == 0
    timings = body["timings"]
    assert timings["predicted_n"] == 12 and timings["prompt_n"] + timings["cache_n"] == len(tokens)
    assert all(timings[k] >= 0 for k in ("prompt_ms", "predicted_ms", "predicted_per_second"))
    assert body["tokens_cached"] == len(tokens) + 11  # in the KV cache: the last token is not evaluated
    status, again = post(server, "/completions", {"prompt": "Building a website can be done in", "n_predict": 12,
                                                  "temperature": 0})
    assert again["content"] == text and again["tokens"] == []  # tokens only with return_tokens


def test_a_streamed_completion_sends_the_same_text_and_ends_with_the_totals(server):
    body = {"prompt": "The experts of a token", "n_predict": 16, "temperature": 0}
    whole = post(server, "/completion", body)[1]
    payloads = events(server, "/completion", body)
    assert "[DONE]" not in payloads  # llama-server's own stream has no OpenAI end marker
    chunks = [json.loads(p) for p in payloads]
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert sum(len(c["tokens"]) for c in chunks[:-1]) <= 16 and chunks[-1]["tokens_predicted"] == 16
    assert {k: chunks[-1][k] for k in ("stop_type", "tokens_evaluated", "prompt")} == \
        {k: whole[k] for k in ("stop_type", "tokens_evaluated", "prompt")}


def test_timings_per_token_gives_each_chunk_the_timings_so_far(server):
    """llama-server's timings_per_token (its web UI's live speed): each streamed chunk with the timings
    of the generation up to it; without it, the last only."""
    body = {"prompt": "The experts of a token", "n_predict": 8, "temperature": 0}
    chunks = [json.loads(p) for p in events(server, "/completion", {**body, "timings_per_token": True})]
    assert all("timings" in c for c in chunks)
    predicted = [c["timings"]["predicted_n"] for c in chunks]
    assert predicted == sorted(predicted) and predicted[-1] == 8 == chunks[-1]["tokens_predicted"]
    assert {c["timings"]["prompt_n"] + c["timings"]["cache_n"] for c in chunks} == {chunks[-1]["tokens_evaluated"]}
    assert [("timings" in c) for c in (json.loads(p) for p in events(server, "/completion", body))][-2:] == [False, True]
    assert post(server, "/completion", {**body, "timings_per_token": 1})[0] == 400


def test_return_progress_streams_the_prompts_evaluation_first(server):
    """llama-server's return_progress: events with prompt_progress as the prompt's evaluation begins and
    after each n_batch tokens, before the text's, which is what a stream without them sends."""
    body = {"prompt": " ".join(f"w{i}" for i in range(60)), "n_predict": 6, "temperature": 0}
    plain = [json.loads(p) for p in events(server, "/completion", body)]
    chunks = [json.loads(p) for p in events(server, "/completion", {**body, "return_progress": True})]
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert all("prompt_progress" in c for c in chunks[:len(progress)])
    total = plain[-1]["tokens_evaluated"]
    assert total > N_BATCH and {(p["total"], p["cache"]) for p in progress} == {(total, total - 1)}  # held: all but one
    assert [p["processed"] for p in progress] == [total - 1, total]
    assert "".join(c["content"] for c in chunks) == "".join(c["content"] for c in plain)
    fresh = [json.loads(p) for p in events(server, "/completion", {**body, "return_progress": True,
                                                                    "prompt": "x " + body["prompt"]})]
    processed = [c["prompt_progress"]["processed"] for c in fresh if "prompt_progress" in c]
    assert processed[-1] == fresh[-1]["tokens_evaluated"] and processed == sorted(processed) and len(processed) > 2
    timed = [json.loads(p) for p in events(server, "/completion", {**body, "return_progress": True,
                                                                    "timings_per_token": True})]
    assert all("timings" in c for c in timed) and "prompt_progress" in timed[0]  # every chunk, as llama-server's
    for c in (c for c in timed if "prompt_progress" in c):  # a progress chunk's: the evaluation's so far
        p, t = c["prompt_progress"], c["timings"]
        assert (t["cache_n"], t["prompt_n"], t["prompt_ms"], t["predicted_n"]) == \
            (p["cache"], p["processed"] - p["cache"], pytest.approx(p["time_ms"], abs=1), 0)
    whole = post(server, "/completion", {**body, "return_progress": True})[1]  # streamed only, as llama-server's
    assert "prompt_progress" not in whole and whole["content"] == "".join(c["content"] for c in plain)


def test_a_stop_word_ends_it_and_is_named(server, engine):
    tokens = engine.tokenize("x = ", add_bos=True, special=True)
    text, _ = greedy(engine, tokens, 24)
    word = next(text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].isascii() and text[i:i + 2].isalpha())
    status, body = post(server, "/completion", {"prompt": "x = ", "n_predict": 24, "temperature": 0, "stop": [word]})
    assert status == 200 and body["stop_type"] == "word" and body["stopping_word"] == word
    assert body["content"] == text[:text.index(word)]


def test_n_probs_gives_each_tokens_likeliest(server):
    status, body = post(server, "/completion", {"prompt": "abc", "n_predict": 3, "temperature": 0, "n_probs": 3})
    probabilities = body["completion_probabilities"]
    assert status == 200 and len(probabilities) == 3
    for p in probabilities:
        assert len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"]  # greedy: the likeliest
        assert p["logprob"] == pytest.approx(max(t["logprob"] for t in p["top_logprobs"]))
        assert bytes(p["bytes"]).decode("utf-8", "replace") == p["token"]


def test_a_prompt_may_mix_text_and_token_ids(server, engine):
    head, tail = engine.tokenize("one", add_bos=True, special=True), engine.tokenize(" three", add_bos=False)
    ids = engine.tokenize(" two", add_bos=False)
    status, body = post(server, "/completion", {"prompt": ["one", *ids, " three"], "n_predict": 6, "temperature": 0})
    assert status == 200 and body["tokens_evaluated"] == len(head + ids + tail)
    assert body["content"] == greedy(engine, head + ids + tail, 6)[0]


def infill_expected(engine, prefix: str, suffix: str, middle: str) -> list[int]:
    """llama-server's format_prompt_infill with no other files and no repository tokens:
    [BOS] [FIM_PRE] prefix middle [FIM_SUF] suffix [FIM_MID], the prefix's last 3/4 of a batch, the
    suffix's first quarter less the middle and two."""
    pre, suf = engine.tokenize(prefix, add_bos=False), engine.tokenize(suffix, add_bos=False)
    mid = engine.tokenize(middle, add_bos=False, special=True)
    pre, suf = pre[len(pre) - min(len(pre), 3 * (N_BATCH // 4)):], suf[:max(0, N_BATCH // 4 - 2 - len(mid))]
    bos = [engine.token_bos()] if engine.add_bos else []
    return bos + [FIM["pre"], *pre, *mid, FIM["suf"], *suf, FIM["mid"]]


@pytest.mark.parametrize("prefix, suffix, middle", [
    ("def add(a, b):\n    ", "\n    return c\n", ""),
    ("x" * 400, "y" * 400, "z"),  # both longer than their shares of a batch: cut as llama-server cuts them
])
def test_infill_fills_the_middle_with_llama_servers_prompt(server, engine, prefix, suffix, middle):
    expected = infill_expected(engine, prefix, suffix, middle)
    status, body = post(server, "/infill", {"input_prefix": prefix, "input_suffix": suffix, "prompt": middle,
                                            "n_predict": 8, "temperature": 0})
    assert status == 200, body
    assert body["tokens_evaluated"] == len(expected) and body["prompt"] == engine.detokenize(expected, special=True)
    assert body["content"] == greedy(engine, expected, 8)[0]


def test_infill_takes_other_files_where_the_context_leaves_room(server, engine):
    extra = [{"filename": "util.py", "text": "def helper():\n    pass\n"}]
    status, body = post(server, "/infill", {"input_prefix": "a", "input_suffix": "b", "input_extra": extra,
                                            "n_predict": 2, "temperature": 0})
    plain = post(server, "/infill", {"input_prefix": "a", "input_suffix": "b", "n_predict": 2, "temperature": 0})[1]
    snippet = engine.tokenize("\n\n--- snippet ---\n\n", add_bos=False) + engine.tokenize(extra[0]["text"],
                                                                                        add_bos=False)
    assert status == 200 and body["tokens_evaluated"] == plain["tokens_evaluated"] + len(snippet)
    assert body["prompt"].startswith(engine.detokenize(snippet, special=True))


def test_infill_needs_the_models_fill_in_the_middle_tokens(model, tmp_path):
    proc, url = start_server(tmp_path / "server.log", *ARGS, model=model)
    try:
        status, body = post(url, "/infill", {"input_prefix": "a", "input_suffix": "b"})
        assert status == 400 and "no fill-in-the-middle pre, suf, mid token" in body["error"]["message"]
    finally:
        stop_server(proc)


@pytest.mark.parametrize("path, body, message", [
    ("/completion", {"prompt": "x", "samplers": ["top_k", "nucleus", "warp"]}, "'samplers' must be llama.cpp's"),
    ("/completion", {"prompt": "x", "n_keep": 4}, "'n_keep' = 4 is not supported"),
    ("/completion", {"prompt": "x", "n_predict": 4, "max_tokens": 5}, "disagree"),
    ("/completion", {"prompt": [1, {"x": 1}]}, "'prompt' must be a non-empty string, or a list of strings"),
    ("/completion", {"prompt": "x", "logit_bias": [["ab"]]}, "'logit_bias' must be [[token, bias], ...]"),
    ("/completion", {"prompt": "x", "logit_bias": {"5": True}}, "'logit_bias[5]' must be a number"),
    ("/completion", {"prompt": "x", "repeat_last_n": -2}, "'repeat_last_n' must be an integer in [-1,"),
    ("/completion", {}, "'prompt' is required"),
    ("/infill", {"input_prefix": "a"}, "'input_suffix' is required"),
    ("/infill", {"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": 1}]}, "'input_extra' must be"),
])
def test_a_bad_request_is_a_400_naming_what(server, path, body, message):
    status, answer = post(server, path, body)
    assert status == 400 and message in answer["error"]["message"], answer


def test_llama_servers_settings_at_their_defaults_and_its_own_names_are_taken(server, engine):
    status, body = post(server, "/completion", {
        "prompt": "abc", "n_predict": 4, "temperature": 0, "cache_prompt": True, "id_slot": -1, "n_keep": 0,
        "min_keep": 0, "dynatemp_range": 0, "post_sampling_probs": False, "repeat_last_n": -1, "mirostat": 0,
        "samplers": "edskypmxt",
        "logit_bias": [["zz", False], [7, -1.5]], "ignore_eos": True})
    assert status == 200, body
    assert body["generation_settings"]["repeat_last_n"] == engine.n_ctx and body["tokens_predicted"] == 4
    banned = set(engine.tokenize("zz", add_bos=False))
    assert not banned & set(post(server, "/completion", {"prompt": "zz zz zz", "n_predict": 8, "return_tokens": True,
                                                        "logit_bias": [["zz", False]], "seed": 3})[1]["tokens"])


def test_the_end_of_generation_token_is_counted_as_llama_server_counts_it(server, engine):
    eos = engine.token_eos()
    status, body = post(server, "/completion", {"prompt": "abc", "n_predict": 8, "logit_bias": {str(eos): 100},
                                                "return_tokens": True, "n_probs": 1})
    assert status == 200 and body["stop_type"] == "eos" and body["content"] == ""
    assert body["tokens"] == [eos] and body["tokens_predicted"] == 1
    assert [p["id"] for p in body["completion_probabilities"]] == [eos]
    chunks = [json.loads(p) for p in events(server, "/completion", {"prompt": "abc", "n_predict": 8,
                                                                    "logit_bias": {str(eos): 100}})]
    assert [(c["content"], c["tokens"], c["stop"]) for c in chunks] == [("", [eos], False), ("", [], True)]



def test_llama_servers_samplers_beyond_llama_cpp_pythons(server, engine):
    body = {"prompt": "x = ", "n_predict": 32, "temperature": 0}
    dry = {"dry_multiplier": 0.8, "dry_base": 1.5, "dry_allowed_length": 1, "dry_sequence_breakers": ["\n"]}
    plain, repeated_less = post(server, "/completion", body)[1], post(server, "/completion", {**body, **dry})[1]
    ids = list(engine.generate_tokens(engine.tokenize("x = ", add_bos=True, special=True), 32,
                                      SamplingParams(temperature=0.0, **dry)))
    assert repeated_less["content"] == b"".join(engine.token_piece(t) for t in ids).decode("utf-8", "replace")
    assert repeated_less["content"] != plain["content"]
    status, answer = post(server, "/completion", {**body, "dry_sequence_breakers": [""]})
    assert status == 400 and "'dry_sequence_breakers' must be a list" in answer["error"]["message"]


@pytest.fixture(scope="module")
def code_server(tmp_path_factory):
    """The demo model (trained on code, every expert in HIGH) behind the server: text with lines."""
    proc, url = start_server(tmp_path_factory.mktemp("code") / "server.log", "-t", "1", "-c", str(N_CTX),
                             "--system", "lossless", model=DEMO)
    yield url
    stop_server(proc)


def test_a_line_less_indented_than_n_indent_ends_it_as_llama_vim_asks(code_server):
    with Engine(DEMO, n_ctx=N_CTX, n_threads=1, system="lossless") as eng:
        text = eng.generate("def add(a, b):\n    ", 96, temperature=0.0)
    line = text.index("\n") + 1  # the first line after the first line break
    indent = len(text[line:]) - len(text[line:].lstrip(" \t"))
    assert indent < 4  # the greedy text leaves the function's body
    status, body = post(code_server, "/completion", {"prompt": "def add(a, b):\n    ", "n_predict": 96,
                                                     "temperature": 0, "n_indent": 4})
    assert status == 200 and body["content"] == text[:line + indent] and body["stop_type"] == "limit"
    status, fields = post(code_server, "/completion", {"prompt": "def add(a, b):\n    ", "n_predict": 96,
                                                       "temperature": 0, "n_indent": 4, "t_max_prompt_ms": 500,
                                                       "response_fields": ["content", "timings/predicted_n", "x/y"]})
    assert status == 200 and fields == {"content": body["content"], "timings/predicted_n": body["timings"]["predicted_n"]}


def test_samplers_in_another_order_and_the_infill_sampler(code_server):
    body = {"prompt": "import os\n", "n_predict": 16, "seed": 5, "top_k": 40, "top_p": 0.9}
    with Engine(DEMO, n_ctx=N_CTX, n_threads=1, system="lossless") as eng:
        tokens = eng.tokenize("import os\n", add_bos=True, special=True)
        for order in (["top_k", "top_p", "infill"], "kt"):
            ids = list(eng.generate_tokens(tokens, 16, SamplingParams(seed=5, top_k=40, top_p=0.9, samplers=order)))
            answer = post(code_server, "/completion", {**body, "samplers": order, "return_tokens": True})[1]
            assert answer["tokens"][:len(ids)] == ids  # and the end-of-generation token, where it ended so
    status, answer = post(code_server, "/completion", {**body, "samplers": ["top_k", "top_k"]})
    assert status == 400 and "'samplers' must be llama.cpp's samplers in an order" in answer["error"]["message"]
