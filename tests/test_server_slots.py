"""llama-server's slot actions (`serve --slot-save-path PATH`; pyedgemoe.slot_files): a sequence's KV
cache saved to a file, erased, restored, so that a prompt evaluated once is not evaluated again; the
file llama.cpp's sequence state file, which stock llama.cpp (llama-cpp-python) loads too; every bad
slot, action, name or file a 400, and the server goes on."""
from __future__ import annotations

import ctypes
import json
import os

import pytest

from test_server import DEMO, request, start_server, stop_server

PROMPT = "def add(a, b):\n    return"
OTHER = "class Node(object):"
ARGS = ["-t", "1", "-c", "1024"]


def completion(url: str, prompt: str) -> dict:
    status, body = request("POST", url + "/completion", json.dumps(
        {"prompt": prompt, "n_predict": 4, "temperature": 0}).encode())
    assert status == 200, body
    return body


def slot(url: str, n, action: str, filename: str | None = None) -> tuple[int, dict]:
    body = json.dumps({"filename": filename}).encode() if filename is not None else b"" if action == "erase" else b"{}"
    return request("POST", f"{url}/slots/{n}?action={action}", body)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    slots = tmp_path_factory.mktemp("slots")
    proc, url = start_server(slots / "server.log", *ARGS, "--slot-save-path", str(slots / "saved"))
    yield url, slots / "saved"
    stop_server(proc)


def test_a_slot_saved_and_restored_skips_its_prompt(server):
    url, saved = server
    first = completion(url, PROMPT)
    status, done = slot(url, 0, "save", "prompt.bin")
    assert status == 200 and done["id_slot"] == 0 and done["filename"] == "prompt.bin"
    assert done["n_saved"] == first["tokens_cached"] and done["n_written"] == os.path.getsize(saved / "prompt.bin")
    assert slot(url, 0, "erase") == (200, {"id_slot": 0, "n_erased": done["n_saved"]})
    assert completion(url, PROMPT)["timings"]["cache_n"] == 0  # erased: evaluated again
    completion(url, OTHER)  # the slot holds another prompt
    status, restored = slot(url, 0, "restore", "prompt.bin")
    assert status == 200 and restored["n_restored"] == done["n_saved"] and restored["n_read"] == done["n_written"]
    again = completion(url, PROMPT)
    n_prompt = again["tokens_evaluated"]
    assert again["timings"]["cache_n"] == n_prompt - 1  # all but the last (its logits are needed)
    assert again["content"] == first["content"]  # lossless


@pytest.mark.parametrize("n, action, filename, fragment", [
    (5, "save", "a.bin", "invalid slot '5'"), ("x", "save", "a.bin", "invalid slot 'x'"),
    (0, "load", "a.bin", "invalid action 'load'"), (0, "save", "../a.bin", "filename must be a plain file's name"),
    (0, "save", "a/b", "plain file's name"), (0, "save", ".hidden", "plain file's name"),
    (0, "save", "", "filename must be a file's name"), (0, "save", "x" * 300, "filename must be a file's name"),
    (0, "restore", "missing.bin", "no slot file 'missing.bin'"), (0, "save", None, "'filename' is required"),
])
def test_a_bad_action_is_a_400_naming_it(server, n, action, filename, fragment):
    url, _ = server
    status, body = slot(url, n, action, filename)
    assert status == 400 and fragment in body["error"]["message"], body
    if "plain file" in fragment:
        assert body["error"]["param"] == "filename"


def test_a_damaged_or_foreign_file_is_refused_and_the_slot_goes_on(server, tmp_path):
    url, saved = server
    (saved / "junk.bin").write_bytes(os.urandom(4096))
    status, body = slot(url, 0, "restore", "junk.bin")
    assert status == 400 and "slot file 'junk.bin'" in body["error"]["message"] and str(saved) not in json.dumps(body)
    completion(url, PROMPT)
    status, done = slot(url, 0, "save", "cut.bin")
    data = (saved / "cut.bin").read_bytes()
    (saved / "cut.bin").write_bytes(data[:len(data) // 2])
    status, body = slot(url, 0, "restore", "cut.bin")
    assert status == 400, body
    assert completion(url, PROMPT)["timings"]["cache_n"] == 0  # the slot holds nothing after a failed restore


def test_a_slot_file_that_cannot_be_written_is_a_400_and_the_server_goes_on(server):
    url, saved = server
    (saved / "adir").mkdir()
    completion(url, PROMPT)
    status, body = slot(url, 0, "save", "adir")
    assert status == 400 and "slot file 'adir'" in body["error"]["message"] and "Is a directory" in body["error"]["message"]
    assert str(saved) not in json.dumps(body)
    assert slot(url, 0, "save", "fine.bin")[0] == 200


def test_without_a_slot_directory_slot_actions_are_refused(tmp_path):
    proc, url = start_server(tmp_path / "server.log", *ARGS)
    try:
        status, body = slot(url, 0, "save", "a.bin")
        assert status == 400 and "--slot-save-path" in body["error"]["message"]
    finally:
        stop_server(proc)


def test_slots_of_a_parallel_server(tmp_path):
    """With -np 2 the restored slot is the one a request sharing its prompt takes."""
    proc, url = start_server(tmp_path / "server.log", *ARGS, "-np", "2", "--slot-save-path", str(tmp_path))
    try:
        first = completion(url, PROMPT)
        saved = [slot(url, n, "save", f"s{n}.bin")[1] for n in (0, 1)]
        used = next(n for n in (0, 1) if saved[n]["n_saved"])
        for n in (0, 1):
            assert slot(url, n, "erase")[0] == 200
        status, restored = slot(url, 1, "restore", f"s{used}.bin")
        assert status == 200 and restored["n_restored"] == saved[used]["n_saved"]
        again = completion(url, PROMPT)
        assert again["timings"]["cache_n"] > 0 and again["content"] == first["content"]
    finally:
        stop_server(proc)


def test_stock_llama_cpp_reads_a_slot_file(server, tmp_path):
    """The file is llama.cpp's: stock llama.cpp (llama-cpp-python's low-level API, a context of the
    server's size and -fa) loads it, with the prompt's tokens."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from pyedgemoe.convert.export import export
    url, saved = server
    completion(url, PROMPT)
    status, done = slot(url, 0, "save", "stock.bin")
    assert status == 200
    high = export(DEMO, tmp_path / "demo-high.gguf", precision="high", progress=False)  # stock's: no LOW copies
    llm = llama_cpp.Llama(str(high), n_ctx=1024, flash_attn=True, verbose=False)  # the server's -fa (auto: on)
    tokens = (llama_cpp.llama_token * 1024)()
    n = ctypes.c_size_t(0)
    read = llama_cpp.llama_state_seq_load_file(llm._ctx.ctx, str(saved / "stock.bin").encode(), 0, tokens, 1024,
                                               ctypes.byref(n))
    prompt = llm.tokenize(PROMPT.encode())
    assert read == done["n_written"] and n.value == done["n_saved"] and list(tokens[:len(prompt)]) == prompt
    llm.close()


def test_a_slots_save_and_restore_time_their_file_not_the_wait_for_a_busy_slot(tmp_path):
    """llama-server's save_ms and restore_ms time the file's write and read: a save asked while the
    slot generates waits for it, and that wait is not the save's."""
    import threading
    import time

    from pyedgemoe import Engine, slot_files

    with Engine(DEMO, n_ctx=256, n_threads=1, n_parallel=2) as eng:
        eng.generate("Once upon a time", 4, temperature=0)
        held = threading.Event()

        def busy(sequence):
            held.set()
            time.sleep(1.5)
        holder = threading.Thread(target=eng.on_sequence, args=(0, busy))
        holder.start()
        held.wait()
        start = time.perf_counter()
        saved = slot_files.save(eng, 0, str(tmp_path), "s.bin")
        assert time.perf_counter() - start > 1 and saved["timings"]["save_ms"] < 500
        holder.join()
        holder = threading.Thread(target=eng.on_sequence, args=(0, busy))
        held.clear()
        holder.start()
        held.wait()
        assert slot_files.restore(eng, 0, str(tmp_path), "s.bin")["timings"]["restore_ms"] < 500
        holder.join()
