"""LoRA adapters (--lora, --lora-scaled; llama-cpp-python's lora_path and lora_scale): the same logits
as stock llama-cpp-python with the same adapter on the same file, lossless through the expert cache
where the adapter leaves the experts alone, and refused there, with why, where it does not. The
adapters are GGUF files as llama.cpp's convert_lora_to_gguf.py writes them, of random matrices."""
from __future__ import annotations

import subprocess
import sys
import zlib

import gguf
import numpy as np
import pytest

from pyedgemoe import Engine, InvalidOptionError, Llama
from pyedgemoe.errors import PyEdgeMoEError

SMALL = dict(n_ctx=256, n_threads=2, flash_attn=False, verbose=False)  # flash attention off: llama-cpp-python's
PROMPT = b"An adapter changes the matrices it names by a low-rank product"
ATTENTION = ("attn_q", "attn_v")
EXPERTS = ("ffn_up_exps",)


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return str(tiny_model("qwen3_moe")[0])


def write_adapter(model: str, out, targets: tuple[str, ...], rank: int = 4, alpha: float | int = 8.0,
                  architecture: str | None = None, dtype=np.float32) -> str:
    """A LoRA adapter for model changing its matrices named by targets: lora_a [in, rank] and lora_b
    [rank, out] in ggml's order (each an expert's for the experts' matrices), random, each matrix's
    the same in every adapter (seeded by its name); alpha a float32 (an int: an int32)."""
    reader = gguf.GGUFReader(model)
    writer = gguf.GGUFWriter(str(out), architecture or str(reader.fields["general.architecture"].contents()))
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    (writer.add_int32 if isinstance(alpha, int) else writer.add_float32)("adapter.lora.alpha", alpha)
    for t in reader.tensors:
        if any(t.name.endswith(f".{target}.weight") for target in targets):
            rng = np.random.default_rng(zlib.crc32(t.name.encode()))
            ne = [int(n) for n in t.shape]  # ggml's order: ne[0] the inputs, ne[1] the outputs, ne[2] the experts
            experts = ne[2:]
            writer.add_tensor(f"{t.name}.lora_a", rng.normal(0, 0.3, (*experts, rank, ne[0])).astype(dtype))
            writer.add_tensor(f"{t.name}.lora_b", rng.normal(0, 0.3, (*experts, ne[1], rank)).astype(dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(out)


def top_logprobs(llm, tokens: list[int]) -> dict[str, float]:
    return llm(tokens, max_tokens=1, temperature=0, logprobs=5)["choices"][0]["logprobs"]["top_logprobs"][0]


@pytest.mark.parametrize("targets", [ATTENTION, ATTENTION + EXPERTS], ids=["attention", "and experts"])
def test_an_adapter_gives_stock_llama_cpp_pythons_logits(qwen3, tmp_path, targets):
    llama_cpp = pytest.importorskip("llama_cpp")
    adapter = write_adapter(qwen3, tmp_path / "adapter.gguf", targets)
    theirs = llama_cpp.Llama(model_path=qwen3, lora_path=adapter, lora_scale=0.7, logits_all=True, **SMALL)
    tokens = theirs.tokenize(PROMPT)
    with Llama(model_path=qwen3, lora_path=adapter, lora_scale=0.7, **SMALL) as ours, \
            Llama(model_path=qwen3, **SMALL) as plain:
        first, theirs_first = top_logprobs(ours, tokens), top_logprobs(theirs, tokens)
        assert first.keys() == theirs_first.keys() and first == pytest.approx(theirs_first, abs=1e-4)
        assert first != pytest.approx(top_logprobs(plain, tokens), abs=1e-3)  # the adapter reached llama.cpp
        assert ours(tokens, max_tokens=12, temperature=0)["choices"][0]["text"] == \
            theirs(tokens, max_tokens=12, temperature=0)["choices"][0]["text"]
    theirs.close()


def test_the_expert_cache_serves_an_attention_adapter_losslessly(qwen3, tmp_path):
    adapter = write_adapter(qwen3, tmp_path / "adapter.gguf", ATTENTION)
    with Engine(qwen3, lora=adapter, **SMALL) as resident, Engine(qwen3, lora=adapter, expert_cache="25%",
                                                                  **SMALL) as cached:
        tokens = resident.tokenize(PROMPT.decode())
        expected = resident.create_completion(tokens, max_tokens=16, temperature=0)["choices"][0]["text"]
        assert cached.create_completion(tokens, max_tokens=16, temperature=0)["choices"][0]["text"] == expected
        assert f"\nlora          {adapter} (scale 1)  (" in "\n".join(cached.plan.describe())


def test_an_adapter_of_the_experts_is_refused_beside_the_expert_cache(qwen3, tmp_path):
    adapter = write_adapter(qwen3, tmp_path / "adapter.gguf", ATTENTION + EXPERTS)
    with pytest.raises(InvalidOptionError, match=r"changes the routed experts \(blk\.0\.ffn_up_exps\.weight, ...\)"):
        Engine(qwen3, lora=adapter, expert_cache="25%", **SMALL)
    with Engine(qwen3, lora_scaled=f"{adapter}:0.5", expert_cache="mmap", **SMALL) as mapped, \
            Engine(qwen3, lora_scaled=f"{adapter}:0.5", **SMALL) as resident:
        tokens = resident.tokenize(PROMPT.decode())
        assert mapped.logits(tokens)[-1] == pytest.approx(resident.logits(tokens)[-1], abs=1e-5)


def test_two_adapters_add_up(qwen3, tmp_path):
    one = write_adapter(qwen3, tmp_path / "one.gguf", ("attn_q",))
    other = write_adapter(qwen3, tmp_path / "other.gguf", ("attn_v",))
    both = write_adapter(qwen3, tmp_path / "both.gguf", ("attn_q", "attn_v"))  # the same random matrices
    with Engine(qwen3, lora=f"{one},{other}", **SMALL) as two, Engine(qwen3, lora=both, **SMALL) as single:
        tokens = two.tokenize(PROMPT.decode())
        assert two.logits(tokens)[-1] == pytest.approx(single.logits(tokens)[-1], abs=1e-4)


@pytest.mark.parametrize("make, message", [
    (lambda model, tmp: str(tmp / "missing.gguf"), "LoRA adapter not found"),
    (lambda model, tmp: model, "is not a LoRA adapter"),
    (lambda model, tmp: write_adapter(model, tmp / "llama.gguf", ATTENTION, architecture="llama"),
     "is a LoRA adapter for 'llama', the model is 'qwen3moe'"),
    # each a segmentation fault at the first token (stock's too), or the end of the process on llama.cpp's check
    (lambda model, tmp: write_adapter(model, tmp / "i32.gguf", ATTENTION, dtype=np.int32),
     "is of type I32; llama.cpp applies adapters of float"),
    (lambda model, tmp: write_adapter(model, tmp / "f64.gguf", ATTENTION, dtype=np.float64), "is of type F64"),
    (lambda model, tmp: write_adapter(model, tmp / "alpha.gguf", ATTENTION, alpha=8),
     "adapter.lora.alpha must be a finite float32, got 8"),
    (lambda model, tmp: write_adapter(model, tmp / "nan.gguf", ATTENTION, alpha=float("nan")),
     "adapter.lora.alpha must be a finite float32, got nan"),
])
def test_a_wrong_adapter_is_refused_before_the_load(qwen3, tmp_path, make, message):
    adapter = make(qwen3, tmp_path)
    with pytest.raises(InvalidOptionError, match=message):
        Engine(qwen3, lora=adapter, **SMALL)
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", qwen3, "--lora", adapter, "-p", "hi", "-n", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and message.split("'")[0] in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("arguments, message", [
    (dict(lora_scaled="x.gguf"), "--lora-scaled takes FNAME:SCALE"),
    (dict(lora_scaled="x.gguf:big"), "--lora-scaled takes FNAME:SCALE"),
    (dict(lora="a.gguf,,b.gguf"), "an empty path"),
    (dict(lora_scaled=[("x.gguf", float("nan"))]), "a path and a scale"),
    (dict(lora_scaled="x.gguf:1e39"), "a SCALE a finite C float"),  # infinite there: NaN logits
])
def test_a_bad_adapter_list_is_a_typed_error(qwen3, arguments, message):
    with pytest.raises(InvalidOptionError, match=message):
        Engine(qwen3, **arguments, **SMALL)


def test_logits_an_adapter_overflows_are_named_so_not_a_grammar(qwen3, tmp_path):
    """A scale of 1e30 made every logit NaN: "no token is allowed here: the grammar ... rule out every one"."""
    adapter = write_adapter(qwen3, tmp_path / "adapter.gguf", ATTENTION)
    with Engine(qwen3, lora_scaled=[(adapter, 1e30)], **SMALL) as eng:
        with pytest.raises(PyEdgeMoEError, match="the model's logits are no numbers") as raised:
            eng.generate(eng.tokenize(PROMPT.decode()), 2)
    assert not isinstance(raised.value, InvalidOptionError)  # no fault of the request's (a server's 400)


def test_the_cli_runs_with_an_adapter_as_the_engine_does(qwen3, tmp_path):
    adapter = write_adapter(qwen3, tmp_path / "adapter.gguf", ATTENTION)
    with Engine(qwen3, lora_scaled=f"{adapter}:0.5", n_ctx=256, n_threads=2) as eng:
        expected = eng.generate("An adapter", 8, temperature=0.0)
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "run", qwen3, "--lora-scaled", f"{adapter}:0.5", "-p",
                        "An adapter", "-n", "8", "--temp", "0", "-c", "256", "-t", "2", "--no-display-prompt"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected + "\n"


def test_the_benchmark_runs_stock_with_the_same_adapter(qwen3, tmp_path):
    pytest.importorskip("llama_cpp")
    adapter = write_adapter(qwen3, tmp_path / "adapter.gguf", ATTENTION)
    r = subprocess.run([sys.executable, "-m", "pyedgemoe.cli", "bench", qwen3, "--lora-scaled", f"{adapter}:0.7",
                        "-r", "1", "--no-warmup", "-n", "8", "-p", "16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1].endswith("| yes |")  # the same tokens: the adapter in both


def test_a_state_saved_with_an_adapter_is_refused_without_it(qwen3, tmp_path):
    """The KV cache holds what the adapted weights made of the prompt: it loaded silently into a model
    without the adapter (or with another scale), and the text went on from another model's state."""
    adapter = write_adapter(qwen3, tmp_path / "adapter.gguf", ATTENTION)
    with Engine(qwen3, lora_scaled=[(adapter, 0.5)], **SMALL) as adapted:
        adapted.logits(adapted.tokenize(PROMPT.decode()))
        state = adapted.save_state()
    for options in ({}, dict(lora_scaled=[(adapter, 0.7)])):
        with Engine(qwen3, **options, **SMALL) as other:
            with pytest.raises(InvalidOptionError, match="LoRA adapter.gguf at 0.5"):
                other.load_state(state)
    with Engine(qwen3, lora_scaled=[(adapter, 0.5)], **SMALL) as same:
        same.load_state(state)
