"""`pyedgemoe run --prompt-cache FNAME` (llama.cpp's llama-completion's, with --prompt-cache-all and
--prompt-cache-ro): a second run reuses the prompt's evaluated state and writes the same text; the
file is llama.cpp's session file, read and written by stock llama-cpp-python's own
llama_state_load_file / llama_state_save_file; lossless through an expert cache."""
from __future__ import annotations

import ctypes
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pyedgemoe import Engine

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"
PROMPT = 'def fibonacci(n):\\n    """Return the n-th Fibonacci number."""\\n'  # as typed: -p's escapes


@pytest.fixture(scope="module")
def demo_high(tmp_path_factory) -> Path:
    """The demo model's HIGH precision as a standard GGUF (stock llama.cpp loads it; one precision:
    an expert cache over it is lossless)."""
    from pyedgemoe.convert.export import export

    return export(DEMO, tmp_path_factory.mktemp("stock") / "demo-high.gguf", precision="high", progress=False)


def run(model: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "pyedgemoe", "run", str(model), "-t", "1", "-c", "256", "--temp", "0",
                          "-n", "24", *args], capture_output=True, text=True, timeout=300)
    assert not check or out.returncode == 0, out.stderr
    return out


def prompt_tokens(model: Path) -> list[int]:
    with Engine(model, n_ctx=256, n_threads=1) as eng:
        return eng.tokenize(PROMPT.replace("\\n", "\n"))


def test_a_second_run_reuses_the_prompt_and_writes_the_same_text(demo_high, tmp_path):
    cache = tmp_path / "prompt.bin"
    alone = run(demo_high, "-p", PROMPT).stdout
    first = run(demo_high, "-p", PROMPT, "--prompt-cache", str(cache))
    n = len(prompt_tokens(demo_high))
    assert first.stdout == alone and cache.stat().st_size > 0
    assert f"0 of the prompt's {n} tokens reused, {n} tokens saved" in first.stderr
    second = run(demo_high, "-p", PROMPT, "--prompt-cache", str(cache))
    assert second.stdout == alone
    assert f"{n - 1} of the prompt's {n} tokens reused" in second.stderr  # its last evaluated again, for its logits
    assert "saved" not in second.stderr  # nothing new to write
    # through a 25 % expert cache: the same text (the file holds the KV cache only; --repack: the
    # resident run's kernels)
    assert run(demo_high, "-p", PROMPT, "--prompt-cache", str(cache), "--expert-cache", "25%",
               "--repack").stdout == alone


def test_read_only_and_all(demo_high, tmp_path):
    cache = tmp_path / "prompt.bin"
    run(demo_high, "-p", PROMPT, "--prompt-cache", str(cache), "--prompt-cache-ro")
    assert not cache.exists()
    out = run(demo_high, "-p", PROMPT, "--prompt-cache", str(cache), "--prompt-cache-all", "--json").stdout
    before = cache.read_bytes()
    run(demo_high, "-p", PROMPT + "x = 1", "--prompt-cache", str(cache), "--prompt-cache-ro")
    assert cache.read_bytes() == before  # read, never written
    longer_prompt = tmp_path / "longer.txt"  # the prompt and the text generated, as they are (no escapes)
    longer_prompt.write_text(PROMPT.replace("\\n", "\n") + json.loads(out)["text"] + "x")
    longer = run(demo_high, "-f", str(longer_prompt), "--no-escape", "--prompt-cache", str(cache))
    n = len(prompt_tokens(demo_high))
    reused = int(longer.stderr.split("note: prompt cache")[1].split(": ")[1].split(" of")[0])
    assert reused > n  # the generated text's state was kept too


def test_stock_llama_cpp_reads_and_writes_the_same_files(demo_high, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    tokens = prompt_tokens(demo_high)
    stock = llama_cpp.Llama(model_path=str(demo_high), n_ctx=256, n_threads=1, flash_attn=True, verbose=False)
    try:
        stock.eval(tokens)
        theirs = tmp_path / "theirs.bin"
        array = (llama_cpp.llama_token * len(tokens))(*tokens)
        assert llama_cpp.llama_state_save_file(stock.ctx, str(theirs).encode(), array, len(tokens))
        out = run(demo_high, "-p", PROMPT, "--prompt-cache", str(theirs))
        assert f"{len(tokens) - 1} of the prompt's {len(tokens)} tokens reused" in out.stderr
        assert out.stdout == run(demo_high, "-p", PROMPT).stdout
        ours = tmp_path / "ours.bin"
        run(demo_high, "-p", PROMPT, "--prompt-cache", str(ours))
        stock.reset()
        read = (llama_cpp.llama_token * 256)()
        n = ctypes.c_size_t(0)
        assert llama_cpp.llama_state_load_file(stock.ctx, str(ours).encode(), read, 256, ctypes.byref(n))
        assert list(read[:n.value]) == tokens
    finally:
        stock.close()


def test_what_cannot_be_a_prompt_cache_is_one_error_line(demo_high, tiny_model, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a session file\n")
    other = tmp_path / "other.bin"
    run(tiny_model("qwen3_moe")[0], "-p", "hello", "--prompt-cache", str(other))
    cases = [(["--prompt-cache", str(text)], "prompt cache"), (["--prompt-cache", str(other)], "prompt cache"),
             (["--prompt-cache", str(tmp_path)], "not a file"), (["--prompt-cache-ro"], "--prompt-cache FNAME"),
             (["--prompt-cache", str(text), "--chat"], "--chat")]
    for args, message in cases:
        out = run(demo_high, "-p", PROMPT, *args, check=False)
        lines = out.stderr.strip().splitlines()
        assert out.returncode != 0 and lines[-1].startswith("error:") and message in lines[-1], (args, lines)
        assert "Traceback" not in out.stderr
    assert text.read_text() == "not a session file\n"  # left as it was


def test_a_damaged_file_is_one_error_line(demo_high, tmp_path):
    """llama.cpp's session file: magic, version, the token count, the tokens, the state. A file cut
    short, one of other bytes, one whose tokens are not the vocabulary's or not the state's."""
    good = tmp_path / "good.bin"
    run(demo_high, "-p", PROMPT, "--prompt-cache", str(good))
    data = good.read_bytes()
    n = struct.unpack("<I", data[8:12])[0]
    damaged = {"cut": data[:len(data) // 2], "noise": bytes(range(256)) * 8,
               "token": data[:12] + struct.pack("<i", 2**31 - 1) + data[16:],  # the first token: out of the vocabulary
               "count": data[:8] + struct.pack("<I", n - 1) + data[12:16 + 4 * (n - 1)] + data[16 + 4 * n:]}
    for name, content in damaged.items():
        path = tmp_path / f"{name}.bin"
        path.write_bytes(content)
        out = run(demo_high, "-p", PROMPT, "--prompt-cache", str(path), check=False)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1 and lines[-1].startswith("error: prompt cache"), (name, lines)
        assert "Traceback" not in out.stderr and out.stdout == ""


@pytest.mark.parametrize("arch", ["jamba", "qwen3_next"])
def test_a_hybrid_models_state_files_are_read_back(arch, tiny_model, tmp_path):
    # a recurrent layer's state is one cell at the last position: the file's check took it for damage
    from pyedgemoe import slot_files

    model = tiny_model(arch)[0]
    prompt = "The quick brown fox jumps over the lazy dog. Then"
    alone = run(model, "-p", prompt).stdout
    cache = tmp_path / "prompt.bin"
    n = len(Engine(model, n_ctx=256, n_threads=1).tokenize(prompt))
    # a memory that cannot drop its last token keeps the prompt less it; every later run reuses
    # those (the file was emptied by the second run, which could not cut its state back)
    reused = [f"0 of the prompt's {n} tokens reused, {n - 1} tokens saved"] + [f"{n - 1} of the prompt's {n} tokens "
                                                                                 f"reused\n"] * 2
    for note in reused:
        out = run(model, "-p", prompt, "--prompt-cache", str(cache))
        assert out.stdout == alone and note in out.stderr, out.stderr
    with Engine(model, n_ctx=256, n_threads=1, n_parallel=2) as eng:  # a server's slot, saved and restored
        expected = eng.generate(prompt, 8, temperature=0)
        saved = slot_files.save(eng, 0, str(tmp_path), "slot.bin")
        slot_files.erase(eng, 0)
        assert slot_files.restore(eng, 0, str(tmp_path), "slot.bin")["n_restored"] == saved["n_saved"] > 0
        assert eng.generate(prompt, 8, temperature=0) == expected
