"""Two Engines on one file, in one process (each from a thread of its own) and in two processes at
once: each answers as it does alone. (One Engine from several threads: tests/test_batch.py.)"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pyedgemoe import Engine

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo.gguf"
PROMPTS = ["def add(a, b):", "class Node(object):"]
OPTIONS = [dict(expert_cache="25%", system="lossless"), dict(expert_cache=None)]


@pytest.fixture(scope="module")
def alone() -> list[str]:
    answers = []
    for prompt, options in zip(PROMPTS, OPTIONS):
        with Engine(DEMO, n_threads=1, **options) as eng:
            answers.append(eng.generate(prompt, 48, temperature=0, ignore_eos=True))
    return answers


def test_two_engines_on_one_file_in_one_process(alone):
    engines = [Engine(DEMO, n_threads=1, **options) for options in OPTIONS]
    answers: list[str | None] = [None, None]
    start = threading.Barrier(2)

    def one(i: int) -> None:
        start.wait()
        answers[i] = engines[i].generate(PROMPTS[i], 48, temperature=0, ignore_eos=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for eng in engines:
        eng.close()
    assert answers == alone


def test_two_processes_on_one_file(alone):
    script = ("import json, sys; from pyedgemoe import Engine; "
              "eng = Engine(sys.argv[1], n_threads=1, **json.loads(sys.argv[2])); "
              "print(json.dumps(eng.generate(sys.argv[3], 48, temperature=0, ignore_eos=True)))")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(DEMO), json.dumps(options), prompt],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for prompt, options in zip(PROMPTS, OPTIONS)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    assert [json.loads(out) for out, _ in outs] == alone
