"""--override-kv / Llama(kv_overrides=...): the model's metadata replaced at load, as llama.cpp's
flag and llama-cpp-python's argument do; the MoE use is fewer experts a token. Checked against
stock llama-cpp-python with the same override on the same file, and through the expert cache."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from pyedgemoe import Engine, InvalidOptionError, Llama, ModelLoadError
from pyedgemoe.kv_overrides import canonical, items

USED = "qwen3moe.expert_used_count"
SMALL = dict(n_ctx=256, n_threads=2, verbose=False)


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return str(tiny_model("qwen3_moe")[0])


def greedy(llm, tokens: list[int]) -> str:
    return llm(tokens, max_tokens=16, temperature=0)["choices"][0]["text"]


def test_fewer_experts_a_token_decode_as_stock_llama_cpp_python_with_the_same_override(qwen3):
    llama_cpp = pytest.importorskip("llama_cpp")
    theirs = llama_cpp.Llama(model_path=qwen3, kv_overrides={USED: 1}, **SMALL)
    tokens = theirs.tokenize(b"The experts of a token")
    with Llama(model_path=qwen3, kv_overrides={USED: 1}, **SMALL) as ours, Llama(model_path=qwen3, **SMALL) as plain:
        assert greedy(ours, tokens) == greedy(theirs, tokens) != greedy(plain, tokens)
    theirs.close()


def test_the_expert_cache_serves_the_overridden_count_losslessly(qwen3):
    with Engine(qwen3, override_kv=f"{USED}=int:1", **SMALL) as resident, \
            Engine(qwen3, override_kv=f"{USED}=int:1", expert_cache="25%", **SMALL) as cached:
        tokens = resident.tokenize("The experts of a token")
        expected = resident.create_completion(tokens, max_tokens=16, temperature=0)["choices"][0]["text"]
        assert cached.create_completion(tokens, max_tokens=16, temperature=0)["choices"][0]["text"] == expected
        assert cached.expert_residency["n_expert_used"] == 1 and cached.info.n_experts_used == 1
        assert f"metadata      {USED}=int:1  (--override-kv)" in cached.plan.describe()


def test_a_calibrated_model_routed_to_more_experts_keeps_its_calibration():
    """docs/cli.md's example on the demo model, whose sidecar was calibrated at its own top-2: the
    calibration is the file's, not another model's; lossless at 25 % as resident."""
    demo, used = str(REPO / "models" / "demo.gguf"), "qwen3moe.expert_used_count=int:4"
    with Engine(demo, override_kv=used, **SMALL) as resident, \
            Engine(demo, override_kv=used, expert_cache="25%", low_precision=False, **SMALL) as cached:
        assert cached.plan.fill_ranking and cached.info.n_experts_used == 4
        tokens = resident.tokenize("Once upon a time")
        expected = resident.create_completion(tokens, max_tokens=16, temperature=0)["choices"][0]["text"]
        assert cached.create_completion(tokens, max_tokens=16, temperature=0)["choices"][0]["text"] == expected


def test_a_tokenizer_override_reaches_llama_cpps_vocabulary(qwen3):
    with Engine(qwen3, **SMALL) as plain, Engine(qwen3, override_kv="tokenizer.ggml.add_bos_token=bool:true",
                                                 **SMALL) as with_bos:
        assert with_bos.tokenize("hello") == [with_bos.token_bos(), *plain.tokenize("hello")]


def test_a_dict_becomes_llama_cpps_text_each_value_as_llama_cpp_reads_it():
    text = canonical({USED: 2, "tokenizer.ggml.add_bos_token": False, "general.name": 'a,"b"', "x.rope.freq_base": 1e4})
    assert items(text) == [f"{USED}=int:2", "tokenizer.ggml.add_bos_token=bool:false", 'general.name=str:a,"b"',
                           "x.rope.freq_base=float:10000.0"]
    assert canonical(text) == text and canonical(f"{USED}=int:1_0") == f"{USED}=int:10"


@pytest.mark.parametrize("override, message", [
    ("garbage", "'garbage': give KEY=TYPE:VALUE, TYPE one of int, float, bool, str"),
    (f"{USED}=int:four", "'four' is not an int"),
    (f"{USED}=float:4", f"{USED}: the model holds int there, not float"),  # llama.cpp: warns, drops it
    (f"{USED}=int:0", "0 is not within 1..8"),  # llama.cpp: GGML_ASSERT, the process ends
    (f"{USED}=int:9", "9 is not within 1..8"),
    ("qwen3moe.expert_use_count=int:4", f"no such key in the model.*did you mean {USED}"),  # llama.cpp: ignored
    ("tokenizer.ggml.tokens=str:a", "holds an array there"),
    ("general.name=str:" + "x" * 128, "at most 127 bytes"),
    (f"{USED}=int:{2**63}", "beyond a 64-bit integer"),
    ('general.name=str:"a\rb"', "no line break"),  # found by fuzzing: Python's csv module raised
    ("qwen3moe.context_length=int:-5", "--override-kv: qwen3moe.context_length is -5, not a count"),
])
def test_an_override_llama_cpp_would_drop_or_stop_on_is_one_error(qwen3, override, message):
    with pytest.raises(InvalidOptionError, match=message):
        Engine(qwen3, override_kv=override, **SMALL)
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", qwen3, "--override-kv", override, "-p", "hi",
                        "-n", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stderr.strip().startswith("error: --override-kv") and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_the_cli_runs_with_an_override_as_the_engine_does(qwen3):
    with Engine(qwen3, override_kv=f"{USED}=int:1", **SMALL) as eng:
        expected = eng.create_completion("The experts", max_tokens=8, temperature=0)["choices"][0]["text"]
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", qwen3, "--override-kv", f"{USED}=int:1", "-p",
                        "The experts", "-n", "8", "--temp", "0", "-c", "256"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("The experts" + expected)


def test_the_benchmark_runs_stock_with_the_same_override(qwen3):
    pytest.importorskip("llama_cpp")
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "bench", qwen3, "--override-kv", f"{USED}=int:1",
                        "--repeats", "1", "--warmup", "0", "--output-tokens", "8", "--prompt-tokens", "16"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1].endswith("| yes |")  # the same tokens: one expert a token in both


@pytest.mark.parametrize("override", ["qwen3moe.block_count=int:1", "qwen3moe.attention.head_count=int:0",
                                      "general.architecture=str:llama"])
def test_an_override_llama_cpp_cannot_load_with_is_its_load_error_on_one_line(qwen3, override):
    with pytest.raises(ModelLoadError, match="failed to load model"):
        Engine(qwen3, override_kv=override, **SMALL)
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", qwen3, "--override-kv", override, "-p", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("error: failed to load model") and \
        len(r.stderr.strip().splitlines()) == 1, r.stderr
