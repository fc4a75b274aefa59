"""Ctrl-C (SIGINT) at the moments a user presses it: during generation (CLI and API), the expert
cache fill, a conversion and a calibration. The CLI exits 130 without a traceback; the API raises
KeyboardInterrupt and the Engine goes on working; nothing half-written is left behind."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyedgemoe import Engine
from test_io_faults import DEMO, REPO, faulty_env, layer1  # noqa: F401 - fixtures (shim: conftest)

sys.path.insert(0, str(REPO / "scripts"))
import tiny_moe  # noqa: E402

PROMPT = "def add(a, b):"
CLI = [sys.executable, "-m", "pyedgemoe.cli"]


def start(args: list[str], **kwargs) -> subprocess.Popen:
    """args started with SIGINT at its default, as a shell starts a command in a terminal. A test
    run started in the background has SIGINT ignored, which its children would inherit (Python
    then installs no handler for it)."""
    return subprocess.Popen(args, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kwargs)


def interrupt_when(proc: subprocess.Popen, ready, timeout: float = 60) -> subprocess.CompletedProcess:
    """SIGINT to proc once ready() is true; its exit status and output."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"it ended before the interrupt: {proc.communicate()}"
        assert time.monotonic() < deadline, "never got ready for the interrupt"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_quiet_130(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 130, r.stderr
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr


def test_ctrl_c_during_generation_exits_130_without_a_traceback(tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        proc = start([*CLI, "run", str(DEMO), "-p", PROMPT, "-n", "4000", "--ignore-eos", "-t", "1",
                      "--expert-cache", "25%"], stdout=stdout, stderr=subprocess.PIPE, text=True)
        r = interrupt_when(proc, lambda: out.stat().st_size > len(PROMPT) + 20)
    assert_quiet_130(r)


API_SCRIPT = f"""
import json, sys
from pyedgemoe import Engine
eng = Engine(sys.argv[1], expert_cache="25%", system="lossless", n_threads=1, n_parallel=int(sys.argv[2]))
try:
    for piece in eng.generate({PROMPT!r}, 4000, temperature=0, ignore_eos=True, stream=True):
        sys.stdout.write("piece\\n")  # one write: an interrupt cannot land between the word and its newline
        sys.stdout.flush()
    print(json.dumps({{"interrupted": False}}))
except KeyboardInterrupt:
    print(json.dumps({{"interrupted": True, "after": eng.generate({PROMPT!r}, 24, temperature=0, ignore_eos=True)}}))
"""


@pytest.mark.parametrize("n_parallel", [1, 2])
def test_ctrl_c_in_the_api_raises_keyboard_interrupt_and_the_engine_goes_on(tmp_path, n_parallel):
    with Engine(DEMO, expert_cache="25%", system="lossless", n_threads=1) as eng:
        expected = eng.generate(PROMPT, 24, temperature=0, ignore_eos=True)
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        proc = start([sys.executable, "-c", API_SCRIPT, str(DEMO), str(n_parallel)], stdout=stdout,
                     stderr=subprocess.PIPE, text=True)
        r = interrupt_when(proc, lambda: out.read_text().count("piece") >= 10)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text().splitlines()[-1])
    assert result == {"interrupted": True, "after": expected}


@pytest.mark.parametrize("how", ["generate", "create_completion", "create_chat_completion"])
def test_an_interrupt_between_a_token_and_its_text_frees_the_sequence(how):
    """Ctrl-C landing in the text's code of a stream (not in the token generator's own frame) left
    the run's token generator suspended, holding the one sequence while the traceback lived: the
    next generation in the `except` block was refused (EngineBusyError; seen in CI's timing)."""
    with Engine(DEMO, n_ctx=256, n_threads=1) as eng:
        expected = eng.generate(PROMPT, 8, temperature=0)
        real, calls = eng.token_piece, iter(range(1000))

        def interrupted(token, special=False):
            if next(calls) == 3:
                raise KeyboardInterrupt
            return real(token, special=special)
        eng.token_piece = interrupted
        stream = {"generate": lambda: eng.generate(PROMPT, 50, temperature=0, stream=True),
                  "create_completion": lambda: eng.create_completion(PROMPT, max_tokens=50, stream=True),
                  "create_chat_completion": lambda: eng.create_chat_completion(
                      [{"role": "user", "content": PROMPT}], max_tokens=50, stream=True)}[how]
        try:
            for _ in stream():
                pass
            raise AssertionError("not interrupted")
        except KeyboardInterrupt:
            eng.token_piece = real
            assert eng.generate(PROMPT, 8, temperature=0) == expected


def test_ctrl_c_during_the_cache_fill_exits_130_promptly(shim, layer1, tmp_path):  # noqa: F811
    # a slow disk under layer 1's experts: the fill takes many seconds, the interrupt ends it
    # between two chunks of reads
    mark = tmp_path / "fill-began"
    env = faulty_env(shim, (0, 1 << 40), delay_ms=50, mark=mark)
    proc = start([*CLI, "run", str(DEMO), "-p", PROMPT, "-n", "4", "-t", "1", "--expert-cache", "75%",
                  "--io-threads", "1", "--no-fill-background"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 text=True, env=env)
    r = interrupt_when(proc, mark.exists)
    interrupted = time.monotonic()
    assert_quiet_130(r)
    assert time.monotonic() - interrupted < 15


def test_ctrl_c_during_conversion_leaves_no_file(tmp_path):
    # a checkpoint big enough that its conversion takes a while
    hf = tiny_moe.build_hf_checkpoint("qwen3_moe", tmp_path / "hf", overrides=dict(
        hidden_size=512, intermediate_size=512, moe_intermediate_size=512, num_experts=32, num_hidden_layers=4))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = start([*CLI, "convert", str(hf), "-o", str(out_dir / "model.gguf"), "--high", "q8_0",
                  "--low", "q2_K", "-t", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    r = interrupt_when(proc, lambda: any(out_dir.iterdir()))
    assert_quiet_130(r)
    assert list(out_dir.iterdir()) == []


def test_ctrl_c_during_calibration_leaves_no_sidecar(tmp_path):
    model = tmp_path / "demo.gguf"
    shutil.copy(DEMO, model)
    text = tmp_path / "text.txt"
    text.write_text((REPO / "README.md").read_text() * 4)
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        proc = start([*CLI, "calibrate", str(model), "-f", str(text), "-t", "1"], stdout=subprocess.PIPE,
                     stderr=err, text=True)
        time.sleep(3)  # loaded and calibrating (the model loads in well under a second)
        assert proc.poll() is None, "calibration ended before the interrupt"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    r = subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr.read_text())
    assert_quiet_130(r)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.gguf", "stderr.txt", "text.txt"]
