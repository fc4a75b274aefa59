"""A program that ends while another (daemon) thread decodes or tokenizes exits as Python's programs
do: the decode in flight finishes first (pyedgemoe.native_exit), the daemon thread ends silently (no
"this Engine is closed" traceback), and a thread that comes back from
llama.cpp while Python finalizes waits for the end (native gil_released), where its exit through the
native module's frames ended the process in std::terminate (status 1) or a segfault."""
from __future__ import annotations

import subprocess
import sys

import pytest

from test_io_faults import DEMO

SCRIPT = """
import threading, time
from pyedgemoe import Engine
e = Engine({path!r}, n_threads=1, n_ctx=2048, n_parallel={n_parallel})
started = threading.Event()
def work():
    {work}
threading.Thread(target=work, daemon=True).start()
started.wait(60)
time.sleep({after})
print("done")
"""
DECODING = """for _ in e.generate("Hello", max_tokens=1500, ignore_eos=True, stream=True):
        started.set()"""
# the tokenizer runs without the GIL, beside decodes: the thread came back to finalization's GIL
# (before: a segfault or std::terminate two runs in three)
TOKENIZING = """while True:
        started.set()
        e.tokenize("hello world " * 20000)"""


@pytest.mark.parametrize("n_parallel, work, after", [(1, DECODING, 0.2), (2, DECODING, 0.2), (1, TOKENIZING, 1.0)])
def test_exiting_while_a_daemon_thread_decodes_is_status_0_and_silent(n_parallel, work, after):
    for _ in range(3):  # the exit lands at another point of the work each time
        script = SCRIPT.format(path=str(DEMO), n_parallel=n_parallel, work=work, after=after)
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert (r.returncode, r.stdout, r.stderr) == (0, "done\n", "")


FORKING = """
import os, sys
from pyedgemoe import Engine, ForkedEngineError
e = Engine({path!r}, n_ctx=512, **{options!r})
want = e.generate("def add(a, b):", 8, temperature=0, ignore_eos=True)
tokens = e.tokenize("def add(a, b):")
pid = os.fork()
if pid == 0:
    print("child: tokenizes", e.tokenize("def add(a, b):") == tokens)
    try:
        e.generate("def add(a, b):", 8, temperature=0, ignore_eos=True)
        print("child: generated")
    except ForkedEngineError as err:
        print("child:", type(err).__name__, f"made in process {{os.getppid()}}" in str(err))
    sys.stdout.flush()  # and the child ends as a program does: finalization, the Engine's collection
else:
    _, status = os.waitpid(pid, 0)
    print("parent:", e.generate("def add(a, b):", 8, temperature=0, ignore_eos=True) == want,
          os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("options", [
    dict(expert_cache="25%", n_threads=1),  # the expert cache's reader threads
    dict(n_parallel=2, expert_cache="mmap", n_threads=1),  # the batcher's thread
    dict(expert_cache="mmap"),  # OpenMP's threads (2 here): libgomp's next parallel region in the child waited
], ids=["expert-cache", "n_parallel", "openmp"])
def test_an_engine_in_a_forked_child_is_refused_its_threads_stayed_in_the_parent(options):
    """A child forked after the Engine was made, using it, waited for ever for threads that stayed in the
    parent (and its end, freeing the Engine, joined them): now a ForkedEngineError naming the parent; the
    vocabulary works there, the child ends as a program does and the parent's Engine is unharmed."""
    r = subprocess.run([sys.executable, "-c", FORKING.format(path=str(DEMO), options=options)], capture_output=True,
                       text=True, timeout=120)
    assert (r.returncode, r.stdout.splitlines(), r.stderr) == \
        (0, ["child: tokenizes True", "child: ForkedEngineError True", "parent: True 0"], "")


FORKING_WHILE_BUSY = """
import os, sys, threading
from pyedgemoe import Engine, ForkedEngineError
e = Engine({path!r}, n_threads=1, n_ctx=512, expert_cache="mmap")
inside, go_on = threading.Event(), threading.Event()
def held(ids, logits):  # runs with the Engine's lock held, between two decodes
    inside.set()
    go_on.wait()
    return logits
worker = threading.Thread(target=lambda: e.generate("def add(a, b):", 4, temperature=0, logits_processor=[held]))
worker.start()
inside.wait()
pid = os.fork()
if pid == 0:
    try:
        e.generate("def add(a, b):", 4, temperature=0)
        print("child: generated")
    except ForkedEngineError as err:
        print("child:", type(err).__name__)
    sys.stdout.flush()
    os._exit(0)
go_on.set()
worker.join()
_, status = os.waitpid(pid, 0)
print("parent:", len(e.generate("def add(a, b):", 4, temperature=0)) > 0, os.waitstatus_to_exitcode(status))
"""


def test_an_engine_busy_on_another_thread_at_the_fork_is_refused_in_the_child():
    """Another thread in one of its calls at the fork: the child's copy of the lock is held by a thread it
    does not have (it waited for ever there, before it could be refused)."""
    r = subprocess.run([sys.executable, "-c", FORKING_WHILE_BUSY.format(path=str(DEMO))], capture_output=True,
                       text=True, timeout=120)
    assert (r.returncode, r.stdout.splitlines(), r.stderr) == (0, ["child: ForkedEngineError", "parent: True 0"], "")
