"""ggml's RPC backend (docs/distributed.md) on loopback: llama.cpp's rpc-server protocol, served by
`pyedgemoe rpc-server` processes, the client's devices RPC0, RPC1, ...

Lossless over the wire: the whole model on a remote device, and the device tier with its expert
pools there (gpu at 50 %, 25 % and the minimum: misses uploaded over the socket; coop: misses
computed here), give the tokens of the all-local run, and the all-remote resident run its logits
exactly (the server runs the same CPU kernels). Faults are errors naming the worker: one that is
not there, one that is not an rpc-server, one killed mid-generation (within seconds), one that
hangs (after the timeout); the Engine then closes cleanly. Each client is a process of its own
(tests/rpc/scenario.py): registered RPC devices stay for a process's life."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import tiny_moe  # scripts/, on the path by tests/conftest.py

from pyedgemoe import rpc
from pyedgemoe.errors import InvalidOptionError, RemoteDeviceError

SCENARIO = Path(__file__).parent / "rpc" / "scenario.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """An rpc-server on loopback, in its own process."""

    def __init__(self, cgroup: Path | None = None):
        """cgroup: a memory cgroup (v1) the worker runs in."""
        self.port = free_port()
        enter = (lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid()))) if cgroup else None
        self.log = tempfile.TemporaryFile()  # ggml's log (a pipe nobody read could fill and stop the worker)
        self.proc = subprocess.Popen([sys.executable, "-m", "pyedgemoe", "rpc-server", "--port", str(self.port),
                                      "--threads", "1"], stdout=subprocess.DEVNULL, stderr=self.log, preexec_fn=enter)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert self.proc.poll() is None, self.stderr()
                time.sleep(0.1)
        raise TimeoutError("the rpc-server did not start")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def workers():
    started: list[Worker] = []

    def start(n: int = 1) -> list[Worker]:
        started.extend(Worker() for _ in range(n))
        return started[-n:]
    yield start
    for w in started:
        w.stop()


def scenario(*args, timeout=600) -> dict:
    out = subprocess.run([sys.executable, str(SCENARIO), *map(str, args)], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("arch", tiny_moe.MOE_ARCHITECTURES)
def test_every_mode_over_rpc_gives_the_local_tokens(arch, tiny_model, workers):
    path = tiny_model(arch)[0]
    (worker,) = workers(1)
    result = scenario("tokens", path, worker.endpoint)
    assert result["devices"] == ["RPC0"]
    for name, r in result["runs"].items():
        assert r["device"] == "RPC0", name
        assert r["tokens"] == result["local"], name
    assert result["runs"]["RPC0 resident"]["max_logit_diff"] == 0.0
    assert result["runs"]["RPC0 gpu 25%"]["uploads"] > 0          # misses went over the wire
    assert result["runs"]["RPC0 coop 25%"]["cpu_experts"] > 0      # and here, computed locally
    split = result["runs"]["RPC0 split 25%"]                        # some each way
    assert split["uploads"] > 0 and split["cpu_experts"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", tiny_moe.MOE_ARCHITECTURES)
def test_two_workers_are_two_devices_alone_or_together_and_give_the_local_tokens(arch, tiny_model, workers):
    path = tiny_model(arch)[0]
    a, b = workers(2)
    result = scenario("tokens", path, f"{a.endpoint},{b.endpoint}")
    assert result["devices"] == ["RPC0", "RPC1"]
    assert all(r["tokens"] == result["local"] for r in result["runs"].values())
    # the layers over both (llama.cpp's -dev RPC0,RPC1), each layer's experts cached on its device
    assert result["runs"]["RPC0,RPC1 resident"]["max_logit_diff"] == 0.0
    assert {r["device"] for r in result["runs"].values()} == {"RPC0", "RPC1"}
    for name in ("gpu 50%", "gpu 25%", "gpu minimum", "coop 25%"):
        alone, spread = result["runs"][f"RPC0 {name}"], result["runs"][f"RPC0,RPC1 {name}"]
        assert list(alone["pools"]) == ["RPC0"] and list(spread["pools"]) == ["RPC0", "RPC1"], name
        for run in (alone, spread):  # the budget, in whole slots, on one device or over both
            assert 0.9 * run["budget"] <= sum(run["pools"].values()) <= run["budget"], name
    # a token's top-k on each device: one device's minimum on each
    minimum = result["runs"]["RPC0 gpu minimum"]["pools"]["RPC0"]
    assert list(result["runs"]["RPC0,RPC1 gpu minimum"]["pools"].values()) == [minimum] * 2


def test_servers_are_host_port_lists():
    assert rpc.parse_servers("10.0.0.2:50052, host.lan:7000") == [("10.0.0.2", 50052), ("host.lan", 7000)]
    for bad in ("10.0.0.2", "host:", ":50052", "host:http", "host:70000", "host:\u00b2"):  # "²".isdigit()
        with pytest.raises(InvalidOptionError, match="HOST:PORT"):
            rpc.parse_servers(bad)
    with pytest.raises(InvalidOptionError, match="takes no IPv6 address"):  # ggml splits at the first colon
        rpc.parse_servers("[::1]:50052")


def test_a_worker_that_is_not_there_is_an_error_naming_it():
    port = free_port()
    with pytest.raises(RemoteDeviceError, match=rf"RPC server 127.0.0.1:{port}: cannot connect"):
        rpc.connect(f"127.0.0.1:{port}")


def test_a_listener_that_is_not_an_rpc_server_is_an_error_naming_it():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def answer_nonsense():
            for _ in range(2):  # the reachability check, then ggml's handshake
                conn, _ = listener.accept()
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                conn.close()
        threading.Thread(target=answer_nonsense, daemon=True).start()
        out = subprocess.run([sys.executable, "-c", f"from pyedgemoe import rpc; rpc.connect('127.0.0.1:{port}')"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert f"RemoteDeviceError: RPC server 127.0.0.1:{port}: handshake failed" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("how, within, call", [("SIGKILL", 5, "generate"), ("SIGSTOP", 2 + 5, "generate"),
                                               # its deferred tensor reads aborted (patch 0008)
                                               ("SIGKILL", 5, "save_state")])
def test_a_worker_lost_mid_generation_is_an_error_within_seconds_and_the_engine_closes(how, within, call,
                                                                                      tiny_model, workers):
    path = tiny_model("qwen3_moe")[0]
    (worker,) = workers(1)
    result = scenario("fault", path, worker.endpoint, how, worker.proc.pid, 2, call)
    assert result["first"]  # it ran before
    assert result["error"] == f"RemoteDeviceError: RPC server {worker.endpoint}: connection lost or timed out"
    assert result["again"] == [f"{result['error']} earlier: this Engine can only be closed (its KV cache and "
                               "weights were there)"] * 2
    assert result["seconds"] < within
    assert result["closed"]
    if how == "SIGSTOP":
        worker.proc.send_signal(signal.SIGCONT)


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "pyedgemoe", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_run_with_rpc_gives_the_local_tokens_and_a_missing_worker_is_one_error_line(tiny_model, workers):
    path = tiny_model("qwen3_moe")[0]
    (worker,) = workers(1)
    common = ("run", path, "-p", "hello", "-n", 12, "--temp", 0, "--ignore-eos", "--json", "--ctx", 256)
    local = cli(*common)
    remote = cli(*common, "--rpc", worker.endpoint, "--device", "RPC0", "--mode", "gpu", "--expert-cache", "25%")
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr
    assert json.loads(remote.stdout)["tokens"] == json.loads(local.stdout)["tokens"]
    assert json.loads(remote.stdout)["stats"]["device"] == "RPC0"
    port = free_port()
    missing = cli(*common, "--rpc", f"127.0.0.1:{port}")
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [f"error: RPC server 127.0.0.1:{port}: cannot connect "
                                                   "(Connection refused)"]


def test_a_worker_lost_while_the_model_loads_is_one_error_naming_it(tiny_model):
    """The worker runs in a memory cgroup with a few MiB beside what it holds at rest: the model's
    weights sent to it get it killed (the kernel's OOM killer) halfway through the load."""
    from pyedgemoe.bench.runner import BenchmarkError, check_cgroup_v1, memory_cgroup
    try:
        check_cgroup_v1()
    except BenchmarkError as e:
        pytest.skip(str(e))
    model = Path(__file__).parent.parent / "models" / "demo.gguf"  # 40 MiB of weights to send
    with memory_cgroup(1 << 30) as group:
        worker = Worker(cgroup=group)
        try:
            usage = int((group / "memory.usage_in_bytes").read_text())
            (group / "memory.limit_in_bytes").write_text(str(usage + (8 << 20)))
            r = cli("run", model, "--rpc", worker.endpoint, "--device", "RPC0", "-ngl", -1, "-p", "hi", "-n", 2)
        finally:
            worker.stop()
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"error: RPC server {worker.endpoint}: connection lost or timed out"]


def test_rpc_server_refuses_a_port_in_use(workers):
    (worker,) = workers(1)
    out = cli("rpc-server", "--port", worker.port, timeout=60)
    assert out.returncode == 1 and out.stdout == ""  # refused before llama.cpp's server prints its banner
    assert out.stderr.strip().splitlines() == [f"error: cannot listen on {worker.endpoint}: Address already in use"]
    unknown = cli("rpc-server", "--host", "not.a.host.invalid", "--port", 1, timeout=60)
    assert unknown.returncode == 1 and unknown.stderr.strip().splitlines()[-1].startswith(
        "error: --host not.a.host.invalid: no IPv4 address (")  # its reason, not "is the port in use?"
    # llama.cpp's server reads a dotted IPv4 address alone: a name or ::1 failed after its banner
    ipv6 = cli("rpc-server", "--host", "::1", "--port", free_port(), timeout=60)
    assert ipv6.returncode == 1 and ipv6.stdout == "" and ipv6.stderr.strip().splitlines() == [
        "error: --host ::1: no IPv4 address (Address family for hostname not supported); llama.cpp's rpc-server "
        "listens on IPv4 only"]


@pytest.mark.parametrize("args", [["-c"], ["--cache", "mine"]])
def test_rpc_server_keeps_sent_tensors_where_c_or_cache_says(tmp_path, args):
    """-c: llama.cpp's rpc-server switch, its cache folder ($LLAMA_CACHE/rpc); --cache: the folder given."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pyedgemoe", "rpc-server", "--port", str(port), "--threads", "1",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path,
                            env={**os.environ, "LLAMA_CACHE": str(tmp_path / "llama")})
    try:
        banner = [proc.stdout.readline() for _ in range(3)]
    finally:
        proc.kill()
        proc.wait()
    folder = tmp_path / "llama" / "rpc" if args == ["-c"] else tmp_path / "mine"
    assert f"  local cache    : {folder if args == ['-c'] else 'mine'}\n" in banner and folder.is_dir()


def test_a_worker_named_by_its_host_name_serves():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pyedgemoe", "rpc-server", "--host", "localhost", "--port",
                             str(port), "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        assert proc.poll() is None, proc.stderr.read()
        out = subprocess.run([sys.executable, "-c", f"from pyedgemoe import rpc; print(rpc.connect('localhost:{port}'))"],
                             capture_output=True, text=True, timeout=60)
    finally:
        proc.terminate()
        proc.wait(30)
    assert out.returncode == 0 and out.stdout == "['RPC0']\n", out.stderr


def test_a_worker_says_why_it_dropped_a_client(workers):
    """Only "Accepted client connection" and "Client connection closed" were printed: ggml's log, where
    stock rpc-server says why (a client of another protocol version), was silenced."""
    (worker,) = workers(1)
    with socket.create_connection(("127.0.0.1", worker.port)) as client:
        client.sendall(bytes([14]) + (3).to_bytes(8, "little") + b"abc")  # HELLO of another size
        with contextlib.suppress(ConnectionResetError):
            assert client.recv(1) == b""  # dropped
    deadline = time.monotonic() + 10
    while "HELLO request size mismatch (3 vs" not in worker.stderr() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "client needs upgrade to protocol v7.x" in worker.stderr()


def test_a_worker_busy_with_another_client_is_named_so(workers):
    """A worker serves one client at a time: a second waited 120 s for a "handshake failed (not an
    rpc-server, or another version of its protocol)"."""
    (worker,) = workers(1)
    with socket.create_connection(("127.0.0.1", worker.port)):  # a client that says nothing holds it
        time.sleep(0.5)
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-c", f"from pyedgemoe import rpc; rpc.connect('{worker.endpoint}')"],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "GGML_RPC_TIMEOUT_S": "2"})
    assert out.returncode == 1 and time.monotonic() - t0 < 20
    assert out.stderr.strip().splitlines()[-1] == (
        f"pyedgemoe.errors.RemoteDeviceError: RPC server {worker.endpoint}: no answer in 2 s: a worker serves one "
        "client at a time (is another one using it?)")


@pytest.mark.slow
def test_a_server_whose_worker_is_lost_is_unhealthy(tiny_model, workers, tmp_path):
    """/health answered 200 "ok" while every request got a 503: a load balancer kept sending them."""
    from test_server import request, start_server, stop_server
    (worker,) = workers(1)
    proc, url = start_server(tmp_path / "log", "--rpc", worker.endpoint, "--device", "RPC0", "-ngl", "-1",
                             "-t", "1", "-c", "256", model=tiny_model("qwen3_moe")[0])
    try:
        body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
        assert request("POST", url + "/v1/completions", body, key=None)[0] == 200
        worker.proc.kill()
        worker.proc.wait()
        assert request("POST", url + "/v1/completions", body, key=None)[0] == 503
        status, answer = request("GET", url + "/health", key=None)
        assert status == 503 and "can only be closed" in answer["error"]["message"], answer
    finally:
        stop_server(proc)
