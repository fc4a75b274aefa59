"""pyedgemoe.Llama: llama-cpp-python's high-level class over the Engine. The examples are
llama-cpp-python's README ("High-level API"); the expected results are the Engine's own at
temperature 0 and, where the file loads there, stock llama-cpp-python's."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyedgemoe import Engine, InvalidOptionError, Llama, ModelLoadError
from pyedgemoe.devices import gpu_devices
from pyedgemoe.llama import UNSUPPORTED_CHAT_ARGS, UNSUPPORTED_COMPLETION_ARGS, UNSUPPORTED_INIT_ARGS

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"
PLANETS = "Q: Name the planets in the solar system? A: "
SOURCE = "def __init__(self, name):\n    self._name = name  # héllo wörld ✓\n"
SMALL = {"n_ctx": 512, "n_threads": 2, "verbose": False}  # what each test's Llama and Engine share


@pytest.fixture(scope="module")
def llm():
    with Llama(model_path=str(DEMO), **SMALL) as llm:
        yield llm


@pytest.fixture(scope="module")
def eng():
    with Engine(DEMO, **SMALL) as eng:
        yield eng


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """Stock llama-cpp-python on the demo model's HIGH precision as a standard GGUF (stock llama.cpp
    does not load the multi-precision file; pyedgemoe runs both the same way), and ours on it."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from pyedgemoe.convert.export import export

    path = export(DEMO, tmp_path_factory.mktemp("stock") / "demo-high.gguf", precision="high", progress=False)
    theirs = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=2, verbose=False)
    with Llama(model_path=str(path), **SMALL) as ours:
        yield theirs, ours
    theirs.close()


# -- llama-cpp-python's README examples --------------------------------------------------------
def test_readme_completion_is_the_engines_at_temperature_0(llm, eng):
    output = llm(PLANETS, max_tokens=32, stop=["Q:", "\n"], echo=False, temperature=0)
    expected = eng.create_completion(PLANETS, max_tokens=32, stop=["Q:", "\n"], temperature=0)
    assert output["object"] == "text_completion" and output["model"] == str(DEMO)
    assert output["choices"] == expected["choices"]
    assert output["usage"] == expected["usage"]


def test_echo_puts_the_prompt_before_the_completion(llm):
    plain = llm(PLANETS, max_tokens=8, stop=["Q:", "\n"], temperature=0)["choices"][0]["text"]
    echoed = llm(PLANETS, max_tokens=8, stop=["Q:", "\n"], echo=True, temperature=0)["choices"][0]["text"]
    assert echoed == PLANETS + plain


def test_call_is_create_completion_and_default_sampling_follows_the_seed(eng):
    with Llama(model_path=str(DEMO), seed=7, **SMALL) as seeded:
        called = seeded("def ", max_tokens=12)["choices"]
        assert seeded.create_completion("def ", max_tokens=12)["choices"] == called
    with Engine(DEMO, seed=7, **SMALL) as engine:
        assert engine.create_completion("def ", max_tokens=12)["choices"] == called


def test_completion_stream_chunks_join_to_the_completion(llm):
    whole = llm("def __init__(self", max_tokens=16, temperature=0)["choices"][0]
    chunks = list(llm("def __init__(self", max_tokens=16, temperature=0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [whole["finish_reason"]]
    echoed = list(llm("def __init__(self", max_tokens=16, temperature=0, stream=True, echo=True))
    assert "".join(c["choices"][0]["text"] for c in echoed) == "def __init__(self" + whole["text"]


def test_model_names_the_result(llm):
    assert llm("def ", max_tokens=2, temperature=0, model="demo")["model"] == "demo"
    assert {c["model"] for c in llm("def ", max_tokens=2, temperature=0, model="demo", stream=True)} == {"demo"}


def test_chat_completion_is_the_engines_at_temperature_0(llm, eng):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "def fib(n):"}]
    out = llm.create_chat_completion(messages=messages, max_tokens=12, temperature=0)
    expected = eng.create_chat_completion(messages, max_tokens=12, temperature=0)
    assert out["object"] == "chat.completion"
    assert out["choices"] == expected["choices"] and out["usage"] == expected["usage"]


def test_chat_completion_streams_the_role_then_the_content_then_the_finish_reason(llm):
    messages = [{"role": "user", "content": "def fib(n):"}]
    whole = llm.create_chat_completion(messages=messages, max_tokens=12, temperature=0)["choices"][0]
    chunks = list(llm.create_chat_completion(messages=messages, max_tokens=12, temperature=0, stream=True))
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]) == whole["message"]["content"]
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]


# -- tokens -----------------------------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip_bytes(llm, eng):
    text = SOURCE.encode("utf-8")
    tokens = llm.tokenize(text)
    assert tokens == eng.tokenize(SOURCE) and tokens[0] == llm.token_bos()
    assert llm.tokenize(text, add_bos=False) == tokens[1:]
    assert llm.detokenize(tokens) == text
    # bytes, not text: one token at a time, a character's bytes may split between tokens
    assert b"".join(llm.detokenize(tokens[i:i + 1], prev_tokens=tokens[:i]) for i in range(len(tokens))) == text


def test_special_token_text_is_parsed_only_with_special(llm):
    marker = llm.detokenize([llm.token_eos()], special=True)
    assert marker == b"<|endoftext|>" and llm.detokenize([llm.token_eos()]) == b""
    assert llm.tokenize(marker, add_bos=False, special=True) == [llm.token_eos()]
    assert llm.token_eos() not in llm.tokenize(marker, add_bos=False)


def test_model_facts(llm):
    assert llm.n_ctx() == 512 and llm.n_vocab() == 8192
    assert llm.metadata["general.architecture"] == "qwen3moe"


def test_tokens_are_stock_llama_cpp_pythons(stock):
    theirs, ours = stock
    text = SOURCE.encode("utf-8")
    for add_bos in (True, False):
        assert ours.tokenize(text, add_bos=add_bos) == theirs.tokenize(text, add_bos=add_bos)
    for fact in ("token_bos", "token_eos", "n_vocab"):
        assert getattr(ours, fact)() == getattr(theirs, fact)()
    # stock llama-cpp-python reads each piece into 32 bytes and returns b"" for the longer ones
    fits = [t for t in range(ours.n_vocab()) if len(ours.detokenize([t], special=True)) <= 32]
    assert len(fits) > ours.n_vocab() - 32
    for special in (False, True):
        assert [ours.detokenize([t], special=special) for t in fits] == \
               [theirs.detokenize([t], special=special) for t in fits]


@pytest.mark.parametrize("prompt", [PLANETS, "def __init__(self", "import os\n"])
def test_a_token_prompt_completes_as_stock_llama_cpp_python(stock, prompt):
    # a text prompt differs there: this file names <|endoftext|> its separator token and stock
    # llama-cpp-python appends that to text prompts (pyedgemoe tokenizes as llama.cpp does)
    theirs, ours = stock
    tokens = ours.tokenize(prompt.encode("utf-8"))
    expected = theirs(tokens, max_tokens=32, stop=["Q:", "\n"], temperature=0)
    output = ours(tokens, max_tokens=32, stop=["Q:", "\n"], temperature=0)
    assert output["choices"] == expected["choices"] and output["usage"] == expected["usage"]


# -- arguments --------------------------------------------------------------------------------
def test_unsupported_constructor_arguments_are_refused_by_name():
    with pytest.raises(InvalidOptionError, match=r"vocab_only=True.*use_mlock=True"):
        Llama(model_path=str(DEMO), vocab_only=True, use_mlock=True, lora_path=None, verbose=False)
    with pytest.raises(InvalidOptionError, match="n_thread"):
        Llama(model_path=str(DEMO), n_thread=2, verbose=False)


def test_unsupported_arguments_at_their_defaults_are_accepted(llm):
    with Llama(model_path=str(DEMO), use_mmap=True, logits_all=False, main_gpu=0, lora_path=None, **SMALL) as same:
        out = same(PLANETS, max_tokens=4, temperature=0, typical_p=1.0, logit_bias=None, mirostat_mode=0)
        assert out["choices"] == llm(PLANETS, max_tokens=4, temperature=0)["choices"]


def test_unsupported_sampling_arguments_are_refused_by_name(llm):
    with pytest.raises(InvalidOptionError, match=r"frequency_penalty=0.5.*mirostat_mode=2"):
        llm(PLANETS, frequency_penalty=0.5, mirostat_mode=2)
    with pytest.raises(InvalidOptionError, match="tools="):
        llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}],
                                   tools=[{"type": "function", "function": {"name": "f"}}])


def test_pyedgemoe_keywords_reach_the_engine():
    with Llama(model_path=str(DEMO), expert_cache="25%", prefetch="hobbit", **SMALL) as cached, \
            Engine(DEMO, expert_cache="25%", prefetch="hobbit", **SMALL) as engine:
        assert cached.engine.expert_residency is not None
        assert cached.engine.stats()["experts"]["prefetch"] == engine.stats()["experts"]["prefetch"]
        assert cached(PLANETS, max_tokens=8, temperature=0)["choices"] == \
               engine.create_completion(PLANETS, max_tokens=8, temperature=0)["choices"]


def test_kv_cache_types_must_agree():
    with pytest.raises(InvalidOptionError, match="type_k=8 and type_v=1 differ"):
        Llama(model_path=str(DEMO), type_k=8, type_v=1, verbose=False)


def test_n_gpu_layers_0_runs_on_the_cpu(llm):
    assert llm.engine.mode == "cpu"


@pytest.mark.skipif(bool(gpu_devices()), reason="this build has a GPU")
@pytest.mark.parametrize("n_gpu_layers", [-1, 20])
def test_n_gpu_layers_on_a_cpu_only_build_runs_on_the_cpu_as_llama_cpp_python_does(n_gpu_layers):
    with Llama(model_path=str(DEMO), n_gpu_layers=n_gpu_layers, **SMALL) as llm:
        assert llm.engine.mode == "cpu"
        assert "this build has none: the CPU" in llm.engine.plan.reasons["mode"]


def test_chat_format_is_the_models_template_or_chatml(llm, tiny_model):
    assert llm.chat_format == "chatml"  # the demo model has no template: the Engine uses ChatML
    with pytest.raises(InvalidOptionError, match="chat_format 'llama-2' is not supported"):
        Llama(model_path=str(DEMO), chat_format="llama-2", verbose=False)
    mixtral = str(tiny_model("mixtral")[0])  # its template renders ChatML
    with Llama(model_path=mixtral, n_ctx=64, verbose=False) as templated:
        assert templated.chat_format == "chat_template.default"
    with Llama(model_path=mixtral, n_ctx=64, chat_format="chatml", verbose=False) as templated:
        assert templated.chat_format == "chatml"


def test_signatures_are_llama_cpp_pythons():
    llama_cpp = pytest.importorskip("llama_cpp")

    def params(f):
        return {n: p.default for n, p in inspect.signature(f).parameters.items()
                if n not in ("self", "kwargs")}

    theirs, ours = params(llama_cpp.Llama.__init__), params(Llama.__init__)
    assert set(theirs) == set(ours) | set(UNSUPPORTED_INIT_ARGS)
    assert {n: theirs[n] for n in ours if n != "seed"} == {n: d for n, d in ours.items() if n != "seed"}
    assert {n: theirs[n] for n in UNSUPPORTED_INIT_ARGS} == UNSUPPORTED_INIT_ARGS
    for method, unsupported in (("create_completion", UNSUPPORTED_COMPLETION_ARGS),
                                ("create_chat_completion", UNSUPPORTED_CHAT_ARGS)):
        theirs, ours = params(getattr(llama_cpp.Llama, method)), params(getattr(Llama, method))
        assert list(theirs) == list(ours)  # positional calls mean the same
        assert {n: theirs[n] for n in unsupported} == unsupported
        assert {n: d for n, d in theirs.items() if n != "stop"} == {n: d for n, d in ours.items() if n != "stop"}


def test_closed_llama_refuses_to_generate():
    with Llama(model_path=str(DEMO), **SMALL) as closed:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        closed(PLANETS, max_tokens=2)


# -- from_pretrained --------------------------------------------------------------------------
def run_offline(code: str, hf_home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home)}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def cache_demo_as_a_hub_repo(hf_home: Path) -> None:
    """The demo model as repo pyedgemoe-tests/demo in the Hub cache under hf_home (its layout:
    refs/main names the snapshot that holds the files)."""
    repo = hf_home / "hub" / "models--pyedgemoe-tests--demo"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "demo.gguf").symlink_to(DEMO)


def test_from_pretrained_offline_of_an_uncached_repo_is_a_model_load_error(tmp_path):
    r = run_offline("from pyedgemoe import Llama, ModelLoadError\n"
                    "try:\n"
                    "    Llama.from_pretrained('pyedgemoe-tests/not-cached', filename='*q8_0.gguf')\n"
                    "except ModelLoadError as e:\n"
                    "    print('ModelLoadError:', e)\n", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ModelLoadError: cannot get *q8_0.gguf from Hugging Face repo "
                               "'pyedgemoe-tests/not-cached' (offline, HF_HUB_OFFLINE=1")
    assert "Traceback" not in r.stderr


def test_from_pretrained_offline_loads_a_cached_file_by_glob(tmp_path, eng):
    cache_demo_as_a_hub_repo(tmp_path)
    r = run_offline("from pyedgemoe import Llama\n"
                    "llm = Llama.from_pretrained('pyedgemoe-tests/demo', '*.gguf', n_ctx=64, verbose=False)\n"
                    "print(llm.model_path)\n"
                    "print(llm.tokenize(b'def f():'))\n", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    path, tokens = r.stdout.splitlines()
    assert Path(path).resolve() == DEMO.resolve()
    assert tokens == str(eng.tokenize("def f():"))


def test_from_pretrained_glob_must_match_one_file(tmp_path):
    cache_demo_as_a_hub_repo(tmp_path)
    r = run_offline("from pyedgemoe import Llama, ModelLoadError\n"
                    "try:\n"
                    "    Llama.from_pretrained('pyedgemoe-tests/demo', '*q4_K_M.gguf')\n"
                    "except ModelLoadError as e:\n"
                    "    print(e)\n", tmp_path)
    assert r.stdout.strip() == "no files of Hugging Face repo 'pyedgemoe-tests/demo' match '*q4_K_M.gguf'; " \
                               "its files: demo.gguf"
