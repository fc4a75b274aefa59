"""A program that ends while another (daemon) thread decodes exits as Python's programs do: the
decode in flight finishes first (pyedgemoe.native_exit), where the thread's exit through the native
module's frames ended the process in std::terminate (status 1)."""
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
    for _ in e.generate("Hello", max_tokens=1500, ignore_eos=True, stream=True):
        started.set()
threading.Thread(target=work, daemon=True).start()
started.wait(60)
time.sleep(0.2)
print("done")
"""


@pytest.mark.parametrize("n_parallel", [1, 2])
def test_exiting_while_a_daemon_thread_decodes_is_status_0(n_parallel):
    for _ in range(3):  # the exit lands at another point of the decode each time
        r = subprocess.run([sys.executable, "-c", SCRIPT.format(path=str(DEMO), n_parallel=n_parallel)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout == "done\n", r.stderr
        assert "llama.cpp stopped" not in r.stderr
