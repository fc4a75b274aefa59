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
