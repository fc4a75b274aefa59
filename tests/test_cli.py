"""`pyedgemoe run` and `pyedgemoe inspect` as a user runs them: streamed text, timings on
stderr, --json, and one-line errors with a non-zero exit for bad input."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from conftest import rewrite_gguf
from pyedgemoe import Engine, ModelLoadError
from pyedgemoe.devices import gpu_devices
from test_convert_hf import phimoe_model  # noqa: F401 (a fixture)


def cli(*args, input_text=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "pyedgemoe.cli", *map(str, args)], capture_output=True,
                          text=True, input=input_text, timeout=timeout)


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [l for l in result.stderr.splitlines() if l.strip() and not l.startswith("note: ")]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_run_streams_the_prompt_and_greedy_text_and_prints_timings(mixtral_gguf):
    r = cli("run", mixtral_gguf, "-p", "hello world", "-n", "8", "--temp", "0", "-t", "2")
    assert r.returncode == 0, r.stderr
    with Engine(mixtral_gguf, n_threads=2) as eng:
        text = eng.generate("hello world", 8, temperature=0)
    assert r.stdout == "hello world" + text + "\n"  # as llama.cpp, the prompt first
    assert "prompt eval:" in r.stderr and "tok/s" in r.stderr
    hidden = cli("run", mixtral_gguf, "-p", "hello world", "-n", "8", "--temp", "0", "-t", "2", "--no-display-prompt")
    assert hidden.stdout == text + "\n"
    colored = cli("run", mixtral_gguf, "-p", "hello world", "-n", "8", "--temp", "0", "-t", "2", "--color")
    assert colored.stdout == "\033[33mhello world\033[0m" + text + "\n"
    # llama.cpp's -co on|off|auto (auto, the default: on a terminal; not this pipe)
    for flags, expected in ((["-co", "on"], colored), (["--color=off"], r), (["-co", "auto"], r), (["--no-color"], r)):
        assert cli("run", mixtral_gguf, "-p", "hello world", "-n", "8", "--temp", "0", "-t", "2",
                   *flags).stdout == expected.stdout, flags


def test_run_json_reports_tokens_and_timings(tiny_model):
    from tokenizers import Tokenizer

    path, hf_dir = tiny_model("mixtral")
    r = cli("run", path, "-p", "hello world", "-n", "8", "--temp", "0", "--json", "-t", "2")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "tokens", "n_prompt_tokens", "prefill_seconds", "decode_tokens_per_second", "stats"}
    assert len(out["tokens"]) == 8 and out["finish_reason"] == "length"
    # the checkpoint's own tokenizer; the model adds no BOS (tiny_moe)
    assert out["n_prompt_tokens"] == len(Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode("hello world"))
    assert out["stats"]["model"]["is_moe"] is True


def test_greedy_run_is_reproducible(mixtral_gguf):
    a = json.loads(cli("run", mixtral_gguf, "-p", "abc", "-n", "12", "--temp", "0", "--json").stdout)
    b = json.loads(cli("run", mixtral_gguf, "-p", "abc", "-n", "12", "--temp", "0", "--json").stdout)
    assert a["tokens"] == b["tokens"]


def test_seeded_sampling_is_reproducible(mixtral_gguf):
    args = ("run", mixtral_gguf, "-p", "abc", "-n", "12", "--temp", "1.0", "--seed", "7", "--json")
    assert json.loads(cli(*args).stdout)["tokens"] == json.loads(cli(*args).stdout)["tokens"]


def test_llama_clis_spellings_of_the_seed_and_the_context(mixtral_gguf):
    # llama-cli's -s and --ctx-size; its seed -1 is a random one
    args = ("run", mixtral_gguf, "-p", "abc", "-n", "12", "--temp", "1.0", "-s", "7", "--ctx-size", "64", "--json")
    assert json.loads(cli(*args).stdout)["tokens"] == json.loads(cli("run", mixtral_gguf, "-p", "abc", "-n", "12", "--temp",
                                                                     "1.0", "--seed", "7", "--json").stdout)["tokens"]
    runs = [cli("run", mixtral_gguf, "-p", "abc", "-n", "24", "--temp", "1.0", "--top-k", "0", "--top-p", "1", "--min-p",
                "0", "--seed", "-1", "--json") for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert json.loads(runs[0].stdout)["tokens"] != json.loads(runs[1].stdout)["tokens"]


def test_llama_clis_mirostat(mixtral_gguf):
    args = ("run", mixtral_gguf, "-p", "abc", "-n", "16", "--temp", "1.0", "--seed", "7", "--json")
    plain = json.loads(cli(*args).stdout)["tokens"]
    mirostat = cli(*args, "--mirostat", "2", "--mirostat-ent", "1", "--mirostat-lr", "0.5")
    assert mirostat.returncode == 0, mirostat.stderr
    assert json.loads(mirostat.stdout)["tokens"] != plain


@pytest.mark.parametrize("value, shown", [("on", "enabled"), ("off", "disabled")])
def test_flash_attention_as_llama_clis_fa(mixtral_gguf, value, shown):
    r = cli("run", mixtral_gguf, "-p", "abc", "-n", "2", "--temp", "0", "-fa", value, "--verbose")
    assert r.returncode == 0, r.stderr
    assert f"flash_attn            = {shown}" in r.stderr


def test_batch_sizes_as_llama_clis_b_and_ub(mixtral_gguf):
    r = cli("run", mixtral_gguf, "-p", "abc", "-b", "16", "-ub", "8", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "batches of 16 in ubatches of 8" in r.stdout
    assert_one_line_error(cli("run", mixtral_gguf, "-p", "abc", "-b", "0"), "n_batch")


def test_prompt_from_file(mixtral_gguf, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello from a file")
    r = cli("run", mixtral_gguf, "-f", prompt, "-n", "4", "--temp", "0", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 4


def test_chat_answers_each_line_with_the_whole_history_until_eof(mixtral_gguf):
    r = cli("run", mixtral_gguf, "--chat", "-n", "4", "--temp", "0", input_text="hi\nhow are you\n")
    assert r.returncode == 0, r.stderr
    messages, expected = [], ""
    with Engine(mixtral_gguf, n_ctx=4096) as eng:
        for line in ("hi", "how are you"):
            messages.append({"role": "user", "content": line})
            reply = eng.create_chat_completion(messages, max_tokens=4, temperature=0)["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": reply})
            expected += f"> {reply}\n"
    assert r.stdout == expected + "> \n"  # a prompt for each line, and one more that reads the EOF
    for flag in ("-cnv", "--conversation"):  # llama-cli's spellings
        assert cli("run", mixtral_gguf, flag, "-n", "4", "--temp", "0", input_text="hi\nhow are you\n").stdout == r.stdout


def test_inspect_reports_experts(mixtral_gguf):
    r = cli("inspect", mixtral_gguf, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    # tiny Mixtral (tiny_moe): llama.cpp's "llama" with 2 layers of 4 experts, top-2
    assert (out["architecture"], out["is_moe"], out["n_layers"], out["n_experts"], out["n_experts_used"]) == \
        ("llama", True, 2, 4, 2)
    # the tensor directory as gguf-py reads it: gate, up and down of 4 experts, 64 x 48 f32 each
    tensors = gguf.GGUFReader(mixtral_gguf).tensors
    per_layer = 3 * 4 * 64 * 48 * 4
    assert out["expert_bytes_per_layer"] == {"0": per_layer, "1": per_layer}
    assert out["expert_bytes"] == sum(int(t.n_bytes) for t in tensors if "_exps." in t.name) == 2 * per_layer
    assert out["non_expert_bytes"] == sum(int(t.n_bytes) for t in tensors if "_exps." not in t.name)
    assert out["file_bytes"] == mixtral_gguf.stat().st_size
    text = cli("inspect", mixtral_gguf)
    assert "experts" in text.stdout and "multi-precision no" in text.stdout


def test_inspect_counts_a_shared_expert_the_file_has_no_count_of(tiny_model):
    """Qwen2-MoE's one shared expert (ffn_*_shexp) was "0 shared": it has no expert_shared_count key."""
    assert json.loads(cli("inspect", tiny_model("qwen2_moe")[0], "--json").stdout)["n_experts_shared"] == 1
    assert json.loads(cli("inspect", tiny_model("qwen3_moe")[0], "--json").stdout)["n_experts_shared"] == 0


def test_inspect_quotes_a_files_name_with_control_characters(mixtral_gguf, tmp_path):
    """A file's name is the file's to choose: a newline or a terminal's escape in it is shown quoted, on
    the line it belongs to (it broke the layout, and an escape reached the terminal)."""
    hostile = rewrite_gguf(mixtral_gguf, tmp_path / "named.gguf", keys={"general.name": "tiny\nlayers   99\x1b[2J"})
    r = cli("inspect", hostile)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and r.stdout.splitlines()[1] == \
        "architecture    llama ('tiny\\nlayers   99\\x1b[2J')", r.stdout
    assert json.loads(cli("inspect", hostile, "--json").stdout)["name"] == "tiny\nlayers   99\x1b[2J"


def test_missing_model_file(tmp_path):
    assert_one_line_error(cli("run", tmp_path / "nope.gguf", "-p", "x"), "not found")


def test_not_a_gguf(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"this is not a model" * 100)
    assert_one_line_error(cli("run", bogus, "-p", "x"), "not a GGUF")
    assert_one_line_error(cli("inspect", bogus), "not a GGUF")


@pytest.mark.parametrize("keep_fraction", [0.5, 0.999])
def test_truncated_gguf(mixtral_gguf, tmp_path, keep_fraction):
    data = mixtral_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep_fraction)])
    assert_one_line_error(cli("run", cut, "-p", "x"), "truncated")


def test_truncated_header(mixtral_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(mixtral_gguf.read_bytes()[:200])
    assert_one_line_error(cli("run", cut, "-p", "x"), "GGUF")


def test_prompt_longer_than_context(mixtral_gguf):
    assert_one_line_error(cli("run", mixtral_gguf, "-p", "hello " * 600, "-c", "32"), "context")


@pytest.mark.parametrize("args, fragment", [
    (("--top-p", "2"), "top_p"),
    (("--temp", "nan"), "temperature"),
    (("--ctx", "-5"), "n_ctx"),
    (("--batch-size", "0"), "n_batch"),  # (--threads 0 is the default thread count, as in llama.cpp)
    (("-n", "-7"), "n-predict"),
    (("--repeat-penalty", "0"), "repeat_penalty"),
    (("--seed", "-2"), "seed"),
    (("--presence-penalty", "nan"), "presence_penalty"),
    (("--typical", "1.5"), "typical_p"),
    (("--mirostat", "3"), "mirostat_mode"),
    (("--mirostat-ent", "-1"), "mirostat_tau"),
    (("-fa", "yes please"), "--flash-attn takes on, off or auto"),
])
def test_invalid_option_values(mixtral_gguf, args, fragment):
    assert_one_line_error(cli("run", mixtral_gguf, "-p", "x", *args), fragment)


def test_no_prompt_is_a_chat_as_llama_clis_unless_told_otherwise(mixtral_gguf):
    chat = cli("run", mixtral_gguf, "-n", "4", "--temp", "0", input_text="hello\n")
    told = cli("run", mixtral_gguf, "-n", "4", "--temp", "0", "--chat", input_text="hello\n")
    assert chat.returncode == 0 and chat.stdout == told.stdout and chat.stdout.startswith("> ")
    assert_one_line_error(cli("run", mixtral_gguf, "--no-chat"), "no prompt")
    assert_one_line_error(cli("run", mixtral_gguf, "--json"), "no prompt")


def test_dense_model_runs_with_a_note(tiny_model):
    dense, _ = tiny_model("llama")
    r = cli("run", dense, "-p", "hello", "-n", "4", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "no experts" in r.stderr


@pytest.mark.parametrize("args, fragment", [
    (("--ctx", "abc"), "--ctx"),
    (("--bogus",), "--bogus"),
])
def test_usage_errors_are_one_line_with_status_2(mixtral_gguf, args, fragment):
    r = cli("run", mixtral_gguf, "-p", "x", *args)
    assert r.returncode == 2
    assert_one_line_error(r, fragment)


def test_expert_cache_run_gives_the_resident_tokens_and_reports_misses(tiny_model):
    olmoe, _ = tiny_model("olmoe")
    base = ("run", olmoe, "-p", "hello world", "-n", "12", "--temp", "0", "--json")
    resident = json.loads(cli(*base).stdout)
    r = cli(*base, "--expert-cache", "50%", "--io", "direct")
    assert r.returncode == 0, r.stderr
    offloaded = json.loads(r.stdout)
    assert offloaded["tokens"] == resident["tokens"]
    assert offloaded["stats"]["experts"]["total"]["misses"] > 0
    assert offloaded["stats"]["experts"]["fill"]["experts"] > 0
    cold = json.loads(cli(*base, "--expert-cache", "50%", "--no-fill-cache").stdout)
    assert cold["tokens"] == resident["tokens"] and cold["stats"]["experts"]["fill"]["experts"] == 0
    text = cli("run", olmoe, "-p", "hello", "-n", "4", "--expert-cache", "50%", "--stats")
    assert "total:" in text.stderr and "misses" in text.stderr and "filled in the background:" in text.stderr


@pytest.mark.parametrize("args, says", [
    ((), "io direct with 4 reads in flight, fill in the background, prefetch none (the cache holds 50% of the "
         "experts), eviction adaptive, lossless, repack off"),
    (("--expert-cache", "25%"), "fill in the background, prefetch none (experts of 24.00 KiB: too small for the "
                                "compute to hide their reads)"),
    (("--repack",), "lossless, repack on"),
    (("--skip",), "eviction adaptive, skip-only (lossy: the misses of the SKIP band are skipped), repack off"),
    (("--no-fill-background", "--io", "buffered", "--io-threads", "2", "--prefetch", "hobbit"),
     "io buffered with 2 reads in flight, fill at load, prefetch hobbit"),
    (("--expert-cache", "25%", "--no-fill-cache", "--cache-policy", "lfu", "-t", "2"),
     "no fill, prefetch none (the decode's threads are given: no core of theirs goes to reads), eviction lfu"),
    (("--expert-cache", "mmap"), "the experts stay in the mapped file"),
])
def test_one_note_line_says_how_the_experts_are_served(tiny_model, args, says):
    olmoe, _ = tiny_model("olmoe")
    r = cli("run", olmoe, "-p", "hi", "-n", "2", "--temp", "0", "--expert-cache", "50%", *args)
    assert r.returncode == 0, r.stderr
    notes = [l for l in r.stderr.splitlines() if l.startswith("note: ")]
    assert len(notes) == 1 and says in notes[0], r.stderr


@pytest.mark.parametrize("args, fragment", [
    (("--expert-cache", "lots"), "expert_cache"),
    (("--expert-cache", "1KiB"), "minimum"),
    (("--io", "magic"), "io"),
    (("--cache-policy", "fifo"), "cache_policy"),
    (("--prefetch", "psychic"), "prefetch"),
    (("--prefetch-depth", "0"), "prefetch_depth"),
    (("--t1", "0.9", "--t2", "0.5"), "must not exceed"),
    (("--policy-weights", "1,1"), "four"),
    (("--low-cache", "1.5"), "low_cache"),
    (("--low-precision",), "LOW expert copies"),
    (("--expert-cache", "mmap", "--repack"), "repack"),
])
def test_invalid_expert_cache_options(tiny_model, args, fragment):
    olmoe, _ = tiny_model("olmoe")
    assert_one_line_error(cli("run", olmoe, "-p", "x", *args), fragment)


def test_ngl_is_llama_cpps_habit_for_the_mode(mixtral_gguf):
    # 0 layers on the GPU is the CPU; any other count the GPU where the build has one (--mode auto),
    # else the CPU, as llama.cpp runs; Llama(n_gpu_layers=...) means the same (test_llama_dropin)
    has_gpu = bool(gpu_devices())
    gpu = "auto" if has_gpu else "cpu"
    for ngl, mode in (("0", "cpu"), ("99", gpu), ("-1", gpu), ("all", gpu), ("auto", "auto" if has_gpu else "cpu")):
        ok = cli("run", mixtral_gguf, "-p", "hi", "-n", "2", "--temp", "0", "-ngl", ngl)
        assert ok.returncode == 0, ok.stderr
        plan = cli("run", mixtral_gguf, "-ngl", ngl, "--dry-run")
        assert plan.returncode == 0 and f"  mode          {mode}  (" in plan.stdout, plan.stdout
    for args, message in ((["-ngl", "0", "--mode", "gpu"], "error: -ngl 0 means --mode cpu, not --mode gpu"),
                          (["-ngl", "99", "--mode", "cpu"], "error: -ngl 99 asks for the GPU and --mode cpu"),
                          (["-ngl", "most"], "error: n_gpu_layers must be -1 or all, 0 (none), a layer count or auto")):
        r = cli("run", mixtral_gguf, "-p", "hi", "-n", "2", *args)
        if args[2:] == ["--mode", "cpu"] and not has_gpu:  # without a GPU, -ngl 99 is the CPU too: they agree
            assert r.returncode == 0, r.stderr
            continue
        assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(message)


def test_kv_cache_types_are_llama_cpps_ctk_and_ctv():
    demo = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"  # heads of 64: q8_0's blocks of 32 fit
    r = cli("run", demo, "-p", "def f(x):", "-n", "8", "--temp", "0", "-t", "2", "-ctk", "q8_0", "-ctv", "q8_0",
            "--no-display-prompt")
    assert r.returncode == 0, r.stderr
    with Engine(demo, n_threads=2, kv_type="q8_0") as eng:
        assert r.stdout == eng.generate("def f(x):", 8, temperature=0) + "\n"
    assert_one_line_error(cli("run", demo, "-p", "hi", "-ctk", "q8_0"),
                          "-ctk q8_0 -ctv f16: pyedgemoe's KV cache takes one type for K and V")



def test_a_context_llama_cpp_refuses_is_one_line_with_its_reason_alone(phimoe_model):
    phimoe = phimoe_model[0]  # its vocabulary draws a warning from llama.cpp's load, which is not the reason
    r = cli("run", phimoe, "-p", "hi", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "off")
    assert_one_line_error(r, "error: cannot create a context of 512 tokens: failed to create a context: "
                          "llama_init_from_model: quantized V cache requires flash_attn to be enabled")
    assert "control-looking token" not in r.stderr


@pytest.mark.parametrize("flag", [["-ot", "exps=CPU"], ["--override-tensor", ".ffn_.*_exps.=CPU"], ["-cmoe"],
                                  ["--cpu-moe"], ["-ncmoe", "4"], ["--n-cpu-moe", "4"],
                                  ["-ot", r"blk\.(1|2)\.ffn_(up|down)_exps=CPU,blk\.3\.ffn_gate_exps\.weight=CPU"]])
def test_llama_cpps_experts_in_host_memory_are_taken_with_a_note(mixtral_gguf, flag):
    # the guides' command lines for large MoEs: experts in host memory, which pyedgemoe's budget places
    r = cli("run", mixtral_gguf, "-p", "hi", "-n", "4", "--temp", "0", "-t", "2", *flag)
    assert r.returncode == 0, r.stderr
    assert r.stdout == cli("run", mixtral_gguf, "-p", "hi", "-n", "4", "--temp", "0", "-t", "2").stdout
    assert "experts stay in host memory where pyedgemoe's expert cache does not hold them" in r.stderr


@pytest.mark.parametrize("value, fragment", [
    ("attn_q=CPU", "matches tensors that are not experts"), ("ffn=CPU", "matches tensors that are not experts"),
    ("exps=CPU,token_embd=CPU", "'token_embd=CPU' matches tensors that are not experts"),
    ("exps=CUDA0", "places tensors in 'CUDA0', not in llama.cpp's CPU"), ("ffn_up_xps=CPU", "matches no tensor"),
    ("exps", "-ot takes <tensor name pattern>=<buffer type>"), ("(=CPU", "not a regular expression"),
])
def test_other_tensor_overrides_answer_with_the_way_here(mixtral_gguf, value, fragment):
    assert_one_line_error(cli("run", mixtral_gguf, "-p", "hi", "-ot", value), fragment,
                          "pyedgemoe places experts by a byte budget" if "=" in value and "(" not in value else "")


def test_jinja_is_taken_as_llama_cpps_command_lines_give_it(mixtral_gguf):
    r = cli("run", mixtral_gguf, "-p", "hello world", "-n", "4", "--temp", "0", "-t", "2", "--jinja")
    assert r.returncode == 0 and r.stdout == cli("run", mixtral_gguf, "-p", "hello world", "-n", "4", "--temp", "0",
                                                  "-t", "2").stdout


@pytest.mark.parametrize("keys, message", [
    ({"llama.expert_used_count": 9}, "llama.expert_used_count is 9, more than llama.expert_count (4)"),
    ({"llama.expert_used_count": None}, "llama.expert_used_count is 0 (or absent) with 4 experts"),
    ({"llama.expert_group_count": 3}, "llama.expert_group_count 3 does not divide the experts (4)"),
])
def test_expert_counts_llama_cpp_would_abort_on_are_a_load_error(mixtral_gguf, tmp_path, keys, message):
    # llama.cpp's loader asserts them (the process ends, the Python API's host with it): checked first
    bad = rewrite_gguf(mixtral_gguf, tmp_path / "bad.gguf", keys=keys)
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        Engine(bad, n_ctx=128)
    assert_one_line_error(cli("run", bad, "-p", "x", "-n", "1"), message)



def test_a_low_copy_of_another_shape_is_refused_by_inspect_run_and_export(tmp_path):
    demo = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"
    bad = rewrite_gguf(demo, tmp_path / "bad.gguf", shrink="blk.0.ffn_up_exps.lowbit")  # half its experts
    message = "the LOW copy blk.0.ffn_up_exps.lowbit has shape"
    for args in (["inspect", bad], ["run", bad, "-p", "x", "-n", "1"], ["export", bad, "-o", tmp_path / "out.gguf"]):
        assert_one_line_error(cli(*args), message)
    assert not (tmp_path / "out.gguf").exists()


def test_thresholds_that_cannot_take_effect_are_said_unused(mixtral_gguf):
    # a standard GGUF without --low-from or --skip: no LOW copies, nothing skipped
    r = cli("run", mixtral_gguf, "-p", "hi", "-n", "2", "--expert-cache", "50%", "--t1", "0.5", "--t2", "0.8")
    assert r.returncode == 0, r.stderr
    assert "note: --t1 0.5 and --t2 0.8 unused: this run has no LOW copies and skips nothing" in r.stderr
    skipping = cli("run", mixtral_gguf, "-p", "hi", "-n", "2", "--expert-cache", "50%", "--t1", "0.5", "--skip")
    assert skipping.returncode == 0 and "unused" not in skipping.stderr
