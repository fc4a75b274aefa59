"""Llama(chat_handler=...): a handler of llama-cpp-python's (its LlamaChatCompletionHandler
protocol) answers every chat, called as llama-cpp-python calls it, and does its work through this
Llama's methods: llama-cpp-python's own Jinja2ChatFormatter handler gives stock llama-cpp-python's
answers on the same file. Its multimodal handlers (a clip model) are refused."""
from __future__ import annotations

import pytest

from pyedgemoe import InvalidOptionError
from pyedgemoe.llama import Llama

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Name a planet."}]
SMALL = dict(n_ctx=512, n_threads=2, verbose=False)


@pytest.fixture(scope="module")
def pair(tiny_model):
    """Stock llama-cpp-python's Llama and ours on the tiny Mixtral, each with llama-cpp-python's
    Jinja2ChatFormatter handler of TEMPLATE."""
    llama_chat_format = pytest.importorskip("llama_cpp.llama_chat_format")
    import llama_cpp
    path = str(tiny_model("mixtral")[0])
    made = [cls(model_path=path, chat_handler=llama_chat_format.Jinja2ChatFormatter(
        TEMPLATE, eos_token="</s>", bos_token="<s>").to_chat_handler(), **SMALL) for cls in (llama_cpp.Llama, Llama)]
    yield made
    for llm in made:
        llm.close()


def without_ids(out: dict) -> dict:
    return {k: v for k, v in out.items() if k not in ("id", "created")}


@pytest.mark.parametrize("kwargs", [dict(max_tokens=12, temperature=0), dict(max_tokens=12, seed=5, temperature=0.9),
                                    dict(max_tokens=24, temperature=0, response_format={"type": "json_object"})])
def test_llama_cpp_pythons_own_handler_answers_as_there(pair, kwargs):
    theirs, ours = pair
    assert without_ids(ours.create_chat_completion(MESSAGES, **kwargs)) == \
        without_ids(theirs.create_chat_completion(MESSAGES, **kwargs))
    chunks, expected = (list(llm.create_chat_completion(MESSAGES, stream=True, **kwargs)) for llm in (ours, theirs))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
        "".join(c["choices"][0]["delta"].get("content") or "" for c in expected)


def test_a_handler_gets_every_argument_by_name_as_from_llama_cpp_python(pair, tiny_model):
    import llama_cpp
    path = str(tiny_model("mixtral")[0])
    seen = []

    def handler(**arguments):
        seen.append((type(arguments["llama"]), sorted(arguments)))
        return {"choices": []}
    for cls in (llama_cpp.Llama, Llama):
        llm = cls(model_path=path, chat_handler=handler, **SMALL)  # stock's Llama is no context manager
        assert llm.create_chat_completion(MESSAGES, temperature=0.3) == {"choices": []}
        assert llm.chat_handler is handler
        llm.close()
    (their_type, theirs), (our_type, ours) = seen
    assert ours == theirs and our_type is Llama


class Llava:  # a multimodal handler's shape (llama-cpp-python's Llava15ChatHandler, MTMDChatHandler)
    clip_model_path = "mmproj.gguf"

    def __call__(self, **arguments):
        raise AssertionError("not called")


@pytest.mark.parametrize("handler, fragment", [(Llava(), "needs llama.cpp's mtmd"), ("chatml", "must be callable")])
def test_multimodal_and_other_handlers_are_refused_by_name(tiny_model, handler, fragment):
    with pytest.raises(InvalidOptionError, match=fragment):
        Llama(model_path=str(tiny_model("mixtral")[0]), chat_handler=handler, **SMALL)
