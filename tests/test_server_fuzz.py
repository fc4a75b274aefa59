"""Hostile bodies against the real server, made (and shrunk, where one fails) by hypothesis: each
endpoint that reads a JSON body gets bodies of its own fields, with values of any JSON type (NaN
and infinities, integers past 64 bits, lone surrogates, nesting) and a well-formed conversation or
prompt now and then so that the checks past the first are reached, plus unknown fields. Every answer
is a 2xx, or a 4xx in OpenAI's error shape naming no internals: never a 5xx; /health answers after.
The examples are derandomized, the same ones on every run (a failing one is printed, shrunk);
FUZZ_EXAMPLES=N (60) an endpoint and FUZZ_RANDOM=1 (new ones each run) search further."""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyedgemoe.server import anthropic_api, responses_api
from pyedgemoe.server.reasoning_control import CONTROL_PARAMETERS
from pyedgemoe.server.request_params import (CHAT_PARAMETERS, COMPLETION_PARAMETERS, DETOKENIZE_PARAMETERS,
                                             INFILL_PARAMETERS, NATIVE_COMPLETION_PARAMETERS, SLOT_FILE_PARAMETERS,
                                             TOKENIZE_PARAMETERS)
from test_server import request, start_server, stop_server

LEAVES = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
          | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
          | st.sampled_from(["\ud800", "", "auto", "none", "user", "assistant", "system", "tool", "text", "json_object",
                             "-1", "0", "function", "reasoning_end"])
          | st.integers(min_value=-2, max_value=64))
VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=8) | st.sampled_from(["role", "content", "type", "text", "name", "function", "parameters"]),
    inner, max_size=3), max_leaves=8)
MESSAGES = st.sampled_from([[{"role": "user", "content": "hi"}],
                            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}],
                            [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
                                {"type": "text", "text": "hi"}]}]])
# the endpoints, their fields, and a well-formed value of the field that opens the deeper checks
ENDPOINTS = {
    "/v1/chat/completions": (CHAT_PARAMETERS, "messages", MESSAGES),
    "/v1/completions": (COMPLETION_PARAMETERS, "prompt", st.sampled_from(["def", [1, 2, 3]])),
    "/completion": (NATIVE_COMPLETION_PARAMETERS, "prompt", st.sampled_from(["def", [1, 2, 3]])),
    "/infill": (INFILL_PARAMETERS, "input_prefix", st.just("def f(")),
    "/v1/messages": (dict.fromkeys(anthropic_api._FIELDS), "messages", MESSAGES),
    "/v1/responses": (dict.fromkeys(responses_api._FIELDS), "input", st.sampled_from(["hi", [
        {"role": "user", "content": "hi"}]])),
    "/tokenize": (TOKENIZE_PARAMETERS, "content", st.just("hello")),
    "/detokenize": (DETOKENIZE_PARAMETERS, "tokens", st.just([1, 2])),
    "/apply-template": (CHAT_PARAMETERS, "messages", MESSAGES),
    "/slots/0?action=save": (SLOT_FILE_PARAMETERS, "filename", st.just("fuzz.bin")),
    "/slots/0?action=restore": (SLOT_FILE_PARAMETERS, "filename", st.just("fuzz.bin")),
    "/v1/chat/completions/control": (CONTROL_PARAMETERS, "id", st.just("chatcmpl-x")),
}


def bodies(fields: dict, key: str, good) -> st.SearchStrategy[dict]:
    names = st.sampled_from(sorted(fields)) | st.text(min_size=1, max_size=8)
    # a small max_tokens where one is well-formed: the generations stay short
    return st.tuples(st.dictionaries(names, VALUES, max_size=6), st.booleans(), good).map(
        lambda t: {**t[0], **({key: t[2]} if t[1] else {}), "max_tokens": 4, "n_predict": 4} if t[1] else t[0])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    where = tmp_path_factory.mktemp("fuzz")
    proc, url = start_server(where / "server.log", "-t", "1", "-c", "256", "--slot-save-path", str(where / "slots"))
    yield url
    stop_server(proc)


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_no_body_gets_a_5xx(server, path):
    fields, key, good = ENDPOINTS[path]

    @settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")), deadline=None, derandomize=os.environ.get("FUZZ_RANDOM") is None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(bodies(fields, key, good))
    def answered(body):
        raw = json.dumps(body, allow_nan=True, ensure_ascii=True)
        status, out = request("POST", server + path, raw.encode())
        assert status < 500, (status, out)
        if status >= 400:
            assert isinstance(out, dict) and set(out["error"]) >= {"message", "type"}, out
            assert "Traceback" not in out["error"]["message"] and "pyedgemoe/" not in out["error"]["message"]
    answered()
    assert request("GET", server + "/health")[0] == 200
