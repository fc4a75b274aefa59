"""llama.cpp's reasoning budget (--reasoning-budget N, --reasoning-budget-message TEXT; llama-server's
reasoning_budget_tokens / thinking_budget_tokens, Anthropic's thinking.budget_tokens): in a chat whose
template has thinking tags, a thought that has taken N tokens is ended, the message and the end tag
forced; 0 ends it at once, -1 leaves it alone.

A random model does not think by itself: test_chat_formats' scripted answer (a logits processor
lifting its tokens) writes a long thought after Qwen3's template, which the budget cuts; a template
whose prompt opens the thought (Nemotron 3 Nano's, an MoE's: `<think>` after the assistant's turn)
has the budget count from the first token the model writes."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest

from conftest import rewrite_gguf
from pyedgemoe import Engine
from pyedgemoe.chat_formats import joined_message
from pyedgemoe.cli_chat import NO_THINKING_TAGS
from pyedgemoe.errors import InvalidOptionError
from test_chat_formats import ASKED, QWEN3_TEMPLATE, engine, model, writes  # noqa: F401 (fixtures)
from test_server import request, start_server, stop_server

TEMPLATES = QWEN3_TEMPLATE.parent
STEPS = " ".join(f"step {i}," for i in range(40))
THOUGHT = f"<think>\n{STEPS}\n</think>\n\nIt is sunny."
MESSAGE = " That is enough thinking."


def reply(engine, script: str = THOUGHT, messages: list[dict] = ASKED, **kwargs) -> dict:
    return engine.create_chat_completion(messages, max_tokens=80, temperature=0, logits_processor=writes(engine, script),
                                         **kwargs)["choices"][0]["message"]


def text_of(engine, tokens: list[int]) -> str:
    return engine.detokenize(tokens)


@pytest.mark.parametrize("budget", [0, 3, 10])
@pytest.mark.parametrize("message", [None, MESSAGE])
def test_a_thought_ends_after_its_budget_with_the_message_and_the_end_tag(engine, budget, message):
    script, start = (engine.tokenize(text, add_bos=False, special=True) for text in (THOUGHT, "<think>"))
    thought = text_of(engine, script[len(start):len(start) + budget])  # the tokens after <think>
    cut = f"<think>{thought}{message or ''}</think>"
    inline = reply(engine, reasoning_budget_tokens=budget, reasoning_budget_message=message)
    assert inline["content"].startswith(cut) and "reasoning_content" not in inline
    apart = reply(engine, reasoning_budget_tokens=budget, reasoning_budget_message=message, reasoning_format="auto")
    assert apart.get("reasoning_content", "").strip() == f"{thought}{message or ''}".strip()
    assert apart["content"] == inline["content"][len(cut):].lstrip()


def test_no_budget_or_minus_one_leaves_the_thought_alone(engine):
    free = reply(engine)
    assert free["content"].startswith(f"<think>\n{STEPS[:100]}")
    assert reply(engine, reasoning_budget_tokens=-1, reasoning_budget_message=MESSAGE) == free
    # a budget larger than the thought: the model's own end is the end (and the answer as without a budget)
    assert reply(engine, reasoning_budget_tokens=1000) == free
    for bad in (-2, 1.5, "3"):
        with pytest.raises(InvalidOptionError, match="reasoning_budget_tokens"):
            reply(engine, reasoning_budget_tokens=bad)


def test_a_new_thought_after_the_end_has_a_budget_of_its_own(engine):
    again = f"<think>\nok\n</think>\n\nSo: <think>\n{STEPS}\n</think>"
    content = reply(engine, again, reasoning_budget_tokens=12, reasoning_budget_message=MESSAGE)["content"]
    first, second = content.split("</think>")[:2]
    thought = second.removeprefix("\n\nSo: <think>").removesuffix(MESSAGE)
    assert first == "<think>\nok\n" and second.endswith(MESSAGE) and thought == f"\n{STEPS}"[:len(thought)]
    assert len(engine.tokenize(thought, add_bos=False)) <= 12


@pytest.fixture(scope="module")
def opened(tiny_model, tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE with Nemotron 3 Nano's template, whose prompt ends in `<think>\\n`."""
    template = (TEMPLATES / "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja").read_text()
    return rewrite_gguf(tiny_model("qwen3_moe")[0], tmp_path_factory.mktemp("opened") / "nemotron-template.gguf",
                        chat_template=template)


@pytest.fixture(scope="module")
def opened_engine(opened):
    with Engine(str(opened), n_ctx=1024, verbose=False) as e:
        yield e


def test_a_thought_the_prompt_opens_counts_from_the_first_token(opened_engine):
    e = opened_engine
    assert e.format_chat(ASKED).endswith("<think>\n")
    script = f"{STEPS}\n</think>\nIt is sunny."
    tokens = e.tokenize(script, add_bos=False, special=True)
    in_prompt = len(e.tokenize("\n", add_bos=False))  # after <think> in the prompt: counted too, as in llama.cpp
    for budget in (0, 5):
        message = reply(e, script, reasoning_budget_tokens=budget, reasoning_budget_message=MESSAGE,
                        reasoning_format="auto")
        thought = text_of(e, tokens[:max(0, budget - in_prompt)])
        assert message["reasoning_content"].strip() == (thought + MESSAGE).strip(), message
        assert message["content"].startswith("step")  # the script's next tokens, after the forced end


@pytest.mark.parametrize("reasoning_format", ["none", "auto"])
def test_its_stream_adds_up_to_its_message(opened_engine, reasoning_format):
    """As llama-server's: the thought the prompt opens shows its tag in a stream too (reasoning_format none)."""
    e, script = opened_engine, f"{STEPS}\n</think>\nIt is sunny."
    kwargs = dict(reasoning_budget_tokens=4, reasoning_budget_message=MESSAGE, reasoning_format=reasoning_format)
    whole = reply(e, script, **kwargs)
    chunks = e.create_chat_completion(ASKED, max_tokens=80, temperature=0, logits_processor=writes(e, script),
                                      stream=True, **kwargs)
    assert joined_message([c["choices"][0]["delta"] for c in list(chunks)[1:-1]]) == whole
    assert whole["content"].startswith("<think>\n") == (reasoning_format == "none")


def test_a_template_without_thinking_tags_has_no_budget(tiny_model, tmp_path):
    """As llama-server: the budget needs the tags llama.cpp's analysis of the template finds."""
    template = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    path = rewrite_gguf(tiny_model("qwen3_moe")[0], tmp_path / "qwen25-template.gguf", chat_template=template)
    with Engine(str(path), n_ctx=1024, verbose=False) as e:
        assert reply(e, reasoning_budget_tokens=0, reasoning_budget_message=MESSAGE) == reply(e)


def cli(model: Path, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", str(model), *arguments], capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_run_chats_with_a_budget_as_llama_cli(opened, opened_engine):
    r = cli(opened, "-cnv", "-st", "-p", ASKED[0]["content"], "-n", "40", "--temp", "0", "-t", "1",
            "--reasoning-budget", "2", "--reasoning-budget-message", MESSAGE)
    chunks = opened_engine.create_chat_completion(ASKED, max_tokens=40, temperature=0, reasoning_budget_tokens=2,
                                                  reasoning_budget_message=MESSAGE, stream=True)
    expected = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert r.returncode == 0 and r.stdout == f"> {ASKED[0]['content']}\n{expected}\n", r.stderr
    assert r.stdout.index(MESSAGE.strip()) < r.stdout.index("</think>")
    for arguments, message in ((["-no-cnv", "-p", "x", "--reasoning-budget", "0"], "--reasoning-budget is a chat's"),
                               (["-cnv", "--reasoning-budget", "-2"], "reasoning_budget_tokens must be >= -1")):
        bad = cli(opened, *arguments)
        assert bad.returncode != 0 and bad.stderr.startswith("error: ") and message in bad.stderr, bad.stderr


def test_run_notes_a_template_without_thinking_tags(model, tmp_path):
    template = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    r = cli(model, "-cnv", "-st", "-p", "hi", "-n", "2", "-t", "1", "--chat-template", template,
            "--reasoning-budget", "0")
    assert r.returncode == 0 and f"note: {NO_THINKING_TAGS}" in r.stderr, r.stderr
    proc, _ = start_server(tmp_path / "server.log", "-t", "1", "--chat-template", template, "--reasoning-budget", "0",
                           model=model)
    stop_server(proc)
    assert f"note: {NO_THINKING_TAGS}" in (tmp_path / "server.log").read_text()


def test_the_server_takes_llama_servers_budget_and_anthropics(opened, opened_engine, tmp_path):
    proc, url = start_server(tmp_path / "server.log", "-t", "1", "-c", "1024", "--reasoning-budget", "1",
                             "--reasoning-budget-message", MESSAGE, model=opened)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        kwargs = dict(model="nemotron-template.gguf", messages=ASKED, max_tokens=10, temperature=0)

        def ours(budget: int) -> str:
            return opened_engine.create_chat_completion(
                ASKED, max_tokens=10, temperature=0, reasoning_budget_tokens=budget,
                reasoning_budget_message=MESSAGE)["choices"][0]["message"]["content"]
        for extra, budget in (({}, 1), ({"reasoning_budget_tokens": -1}, 1), ({"reasoning_budget_tokens": 3}, 3),
                              ({"thinking_budget_tokens": 4}, 4),
                              ({"thinking_budget_tokens": 4, "reasoning_budget_tokens": 2}, 2)):
            answer = client.chat.completions.create(**kwargs, extra_body=extra).choices[0].message.content
            assert answer == ours(budget), extra
        anthropic = {"model": "x", "max_tokens": 10, "temperature": 0, "messages": ASKED,
                     "thinking": {"type": "enabled", "budget_tokens": 3}}
        status, body = request("POST", url + "/v1/messages", json.dumps(anthropic).encode())
        assert status == 200 and body["content"][0]["text"] == ours(3)
        for bad, field in ((dict(reasoning_budget_tokens=-2), "reasoning_budget_tokens"),
                           (dict(thinking_budget_tokens="all"), "thinking_budget_tokens")):
            with pytest.raises(openai.BadRequestError, match=field):
                client.chat.completions.create(**kwargs, extra_body=bad)
        for thinking in ("on", {"type": "enabled", "budget_tokens": -5}, {"type": "enabled", "budget_tokens": "all"}):
            status, body = request("POST", url + "/v1/messages", json.dumps({**anthropic, "thinking": thinking}).encode())
            assert status == 400 and "thinking" in body["error"]["message"], body
    finally:
        stop_server(proc)


def test_a_reasoning_control_ends_the_thought_when_set(opened_engine):
    """llama-server's reasoning control: an Event set while the thought streams ends it at the next
    token (the budget's message, then the end tag), once; unset, the thought goes on."""
    e, script = opened_engine, f"{STEPS}\n</think>\nIt is sunny."
    control = threading.Event()
    chunks = e.create_chat_completion(ASKED, max_tokens=60, temperature=0, logits_processor=writes(e, script),
                                      stream=True, reasoning_control=control, reasoning_budget_message=MESSAGE,
                                      reasoning_format="auto")
    before = [next(chunks) for _ in range(6)]  # the role, then the thought's first tokens
    control.set()
    message = joined_message([c["choices"][0]["delta"] for c in before[1:] + list(chunks)[:-1]])
    thought = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in before)
    assert message["reasoning_content"].strip() == (thought + MESSAGE).strip(), message
    free = reply(e, script, reasoning_control=threading.Event(), reasoning_format="auto")
    assert free == reply(e, script, reasoning_format="auto") and STEPS[:60] in free["reasoning_content"]
    with pytest.raises(InvalidOptionError, match="reasoning_control"):
        reply(e, reasoning_control=True)


def test_the_servers_control_ends_a_running_thought(opened, tmp_path):
    """llama.cpp's web UI's "stop thinking": POST /v1/chat/completions/control {id, reasoning_end}."""
    # a thought long enough to be running when the control comes, on a machine busy with other work
    # (900 tokens of the tiny model took under a second)
    proc, url = start_server(tmp_path / "server.log", "-t", "1", "-c", "8192", "--reasoning-format", "auto",
                             model=opened)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        stream = client.chat.completions.create(model="nemotron-template.gguf", messages=ASKED, max_tokens=8000,
                                                temperature=0, stream=True, extra_body={"reasoning_control": True})
        first = next(stream)
        status, answer = request("POST", url + "/v1/chat/completions/control",
                                 json.dumps({"id": first.id, "action": "reasoning_end"}).encode())
        assert status == 200 and answer == {"success": True}
        # the thought ended: the end tag was written (a random model never writes it), then the text
        assert any(c.choices and c.choices[0].delta.content for c in stream)
        stream.close()
        alone = client.chat.completions.create(model="nemotron-template.gguf", messages=ASKED, max_tokens=40,
                                               temperature=0)
        assert not alone.choices[0].message.content  # without the control: all of it thought
        for body, expected in (({"id": first.id, "action": "reasoning_end"}, (200, {"success": False, "message": "no active completion for this id"})),):
            assert request("POST", url + "/v1/chat/completions/control", json.dumps(body).encode()) == expected
        for body, field in (({"action": "reasoning_end"}, "'id' is required"), ({"id": "x", "action": "stop"}, "action")):
            status, out = request("POST", url + "/v1/chat/completions/control", json.dumps(body).encode())
            assert status == 400 and field in out["error"]["message"], out
    finally:
        stop_server(proc)


def test_run_shows_the_thoughts_apart_as_llama_cli(opened, opened_engine):
    """run --chat --reasoning-format auto: a reply's thoughts between llama-cli's marks, then its text."""
    r = cli(opened, "-cnv", "-st", "-p", ASKED[0]["content"], "-n", "40", "--temp", "0", "-t", "1",
            "--reasoning-budget", "3", "--reasoning-format", "auto")
    message = opened_engine.create_chat_completion(ASKED, max_tokens=40, temperature=0, reasoning_budget_tokens=3,
                                                   reasoning_format="auto")["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"]
    shown = f"[Start thinking]\n\n{message['reasoning_content']}\n[End thinking]\n\n{message['content']}"
    assert r.returncode == 0 and r.stdout == f"> {ASKED[0]['content']}\n{shown}\n", (r.stdout, r.stderr)
    bad = cli(opened, "-no-cnv", "-p", "x", "--reasoning-format", "auto")
    assert bad.returncode != 0 and "--reasoning-format parses a chat's replies" in bad.stderr
