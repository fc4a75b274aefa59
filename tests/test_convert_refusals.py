"""What `convert` and `export` refuse before writing, each one ConversionError (one `error:` line on
the CLI) and no file: a GGUF header gguf-py's reader would believe (the check `inspect` makes runs
first), a type ggml's quantizer does not write, an output path that is no regular file, config.json
settings llama.cpp could not load or would read otherwise. Also what a conversion leaves when
stopped by SIGTERM, and the LOW type it records when row lengths force fallback types.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import pytest

from pyedgemoe.convert import convert
from pyedgemoe.convert.export import export
from pyedgemoe.convert.from_gguf import convert_gguf
from pyedgemoe.errors import ConversionError
from pyedgemoe.gguf_format import LOW_TYPE_KEY, is_low_copy
from pyedgemoe.model_info import read_model_info


def cli(*args) -> subprocess.CompletedProcess:
    # a timeout: gguf-py's reader walked a hostile header's counts for ever
    return subprocess.run([sys.executable, "-m", "pyedgemoe.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=60)


def _string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _header(n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv)  # version 3, no tensors


ARRAY, STRING, U32 = 9, 8, 4
HOSTILE_HEADERS = {
    # an array of 2^60 u32 in a 41-byte file
    "huge-array": _header(1) + _string("x.arr") + struct.pack("<IIQ", ARRAY, U32, 2**60),
    # 100,000 arrays nested in one another
    "nested-arrays": _header(1) + _string("x.arr") + struct.pack("<IIQ", ARRAY, ARRAY, 1) * 100_000
                     + struct.pack("<IQ", U32, 0),
    # general.architecture 2^40 bytes long: gguf-py read it as the rest of the file and export "copied" it
    "huge-string": _header(1) + _string("general.architecture") + struct.pack("<IQ", STRING, 2**40) + b"llama",
}


@pytest.mark.parametrize("kind", HOSTILE_HEADERS)
def test_a_hostile_gguf_header_is_inspects_refusal_in_export_and_convert(tiny_model, tmp_path, kind):
    src, _ = tiny_model("mixtral")
    bad = tmp_path / f"{kind}.gguf"
    bad.write_bytes(HOSTILE_HEADERS[kind])
    inspected = cli("inspect", bad)
    assert inspected.returncode == 1 and inspected.stderr.startswith("error: corrupt GGUF header")
    for args in (("export", bad, "-o", tmp_path / "out.gguf"),
                 ("convert", bad, "-o", tmp_path / "out.gguf"),
                 ("convert", src, "--low-from", bad, "-o", tmp_path / "out.gguf", "--high", "f32")):
        r = cli(*args)
        assert (r.returncode, r.stderr) == (1, inspected.stderr), args
    assert sorted(p.name for p in tmp_path.iterdir()) == [bad.name]


def test_a_tensor_of_no_dimensions_is_refused(tmp_path):
    # ggml's header check passes it (a scalar); gguf-py gives it an empty shape
    path = tmp_path / "scalar.gguf"
    data = _header(1)[:8] + struct.pack("<QQ", 1, 1) + _string("general.architecture") + struct.pack("<I", STRING) \
        + _string("llama") + _string("a.weight") + struct.pack("<IIQ", 0, 0, 0)  # 0 dims, f32, offset 0
    path.write_bytes(data + b"\0" * (-len(data) % 32 + 32))
    assert read_model_info(path).tensor_types == {"f32": 4}
    with pytest.raises(ConversionError, match="tensor a.weight has 0 dimensions, expected 1 to 4"):
        export(path, tmp_path / "out.gguf", progress=False)


def test_a_truncated_gguf_is_called_truncated_by_export(tiny_model, tmp_path):
    src, _ = tiny_model("mixtral")
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(src.read_bytes()[:20_000])
    with pytest.raises(ConversionError, match=r"^truncated GGUF: .* has 20000 bytes but its tensors need"):
        export(bad, tmp_path / "out.gguf", progress=False)


@pytest.mark.parametrize("what", ["fifo", "directory"])
def test_a_source_that_is_not_a_file_is_named_so(tmp_path, what):
    path = tmp_path / "model.gguf"
    os.mkfifo(path) if what == "fifo" else path.mkdir()
    r = cli("export", path, "-o", tmp_path / "out.gguf")
    assert (r.returncode, r.stderr) == (1, f"error: not a file: {path}\n")
    if what == "fifo":  # a directory is an HF checkpoint's
        r = cli("convert", path, "-o", tmp_path / "out.gguf")
        assert (r.returncode, r.stderr) == (1, f"error: not a file or directory: {path}\n")


# -- types ggml's quantizer does not write ------------------------------------------------------------

@pytest.mark.parametrize("option", ["high", "low", "base"])
@pytest.mark.parametrize("type_name", ["f64", "i8", "i32", "q8_1", "q8_K"])
def test_a_type_ggml_cannot_quantize_to_is_refused_naming_the_option(tiny_model, tmp_path, option, type_name):
    src, hf_dir = tiny_model("mixtral")
    for source in (src, hf_dir):
        with pytest.raises(ConversionError, match=f"^--{option} {type_name}: ggml's quantizer does not write "
                                                  f"this type; --{option} takes f32, f16, bf16, q8_0, .*, q4_K,"):
            convert(source, tmp_path / "out.gguf", **{option: type_name}, force=True, progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["two\nlines", "\x1b[2Jcleared", "  ", 7])
def test_a_name_that_is_not_one_printable_line_is_refused(tiny_model, tmp_path, name):
    """general.name is a line of `inspect`, of llama.cpp's load log and of every tool that lists models."""
    with pytest.raises(ConversionError, match=r"--name must be a name on one line"):
        convert(tiny_model("mixtral")[1], tmp_path / "out.gguf", name=name, progress=False)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("threads", [0, -3, 9999, 2.5])
def test_a_thread_count_run_would_refuse_is_refused(tiny_model, tmp_path, threads):
    with pytest.raises(ConversionError, match=r"--threads must be an integer in 1\.\.512"):
        convert(tiny_model("mixtral")[1], tmp_path / "out.gguf", n_threads=threads, progress=False)
    assert list(tmp_path.iterdir()) == []


# -- the output path ---------------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["fifo", "directory", "device"])
def test_an_output_that_is_not_a_regular_file_is_left_alone(tiny_model, tmp_path, what):
    src, _ = tiny_model("mixtral")
    out = tmp_path / "out.gguf"
    if what == "fifo":
        os.mkfifo(out)
    elif what == "directory":
        out.mkdir()
    else:
        out.symlink_to("/dev/null")  # the device itself is a link away: replacing it would need root
    kind = out.lstat().st_mode
    convert_args = ("convert", src, "-o", out, "--force", "--high", "f32", "--low", "f16")
    for args in (("export", src, "-o", out, "--force"), convert_args):
        r = cli(*args)
        assert (r.returncode, r.stderr) == (1, f"error: {out} exists and is not a regular file; give a "
                                               f"file's path as the output\n"), args
    assert out.lstat().st_mode == kind and sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf"]


@pytest.mark.parametrize("command", ["export", "convert"])
def test_an_output_symlink_is_written_through(tiny_model, tmp_path, command):
    src, _ = tiny_model("mixtral")
    target, link = tmp_path / "target.gguf", tmp_path / "link.gguf"
    target.write_bytes(b"old")
    link.symlink_to(target.name)
    extra = ["--high", "f32", "--low", "f16"] if command == "convert" else []
    r = cli(command, src, "-o", link, "--force", *extra)
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and read_model_info(target).architecture == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.gguf", "target.gguf"]


def _copy(src: Path, tmp_path: Path) -> Path:
    """A copy of a tiny model (a checkpoint directory or a GGUF) to aim an output at."""
    dst = tmp_path / src.name
    shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
    return dst


@pytest.mark.parametrize("read", ["model.safetensors", "config.json", "tokenizer.json", "a link to the shard"])
@pytest.mark.parametrize("force", [True, False])
def test_an_output_that_is_a_file_the_conversion_reads_is_refused_even_with_force(tiny_model, tmp_path, read, force):
    hf_dir = _copy(tiny_model("mixtral")[1], tmp_path)
    out = hf_dir / read
    if read == "a link to the shard":
        out = tmp_path / "link.gguf"
        out.symlink_to(hf_dir / "model.safetensors")
    before = {p.name: p.read_bytes() for p in hf_dir.iterdir()}
    with pytest.raises(ConversionError, match=rf"^the output {re.escape(str(out))} is one of the command's inputs: "
                                              rf"give another file$"):
        convert(hf_dir, out, force=force, progress=False)
    assert {p.name: p.read_bytes() for p in hf_dir.iterdir()} == before


def test_an_output_that_is_the_calibration_sidecar_it_embeds_is_refused(tiny_model, tmp_path):
    sidecar = tmp_path / "model.calibration.json"
    shutil.copy(Path(__file__).resolve().parents[1] / "models" / "demo.gguf.calibration.json", sidecar)
    before = sidecar.read_bytes()
    with pytest.raises(ConversionError, match=rf"^the output {re.escape(str(sidecar))} is one of the command's inputs"):
        convert(tiny_model("mixtral")[1], sidecar, calibration=sidecar, force=True, progress=False)
    assert sidecar.read_bytes() == before


def test_an_output_that_is_the_source_gguf_is_refused_on_the_cli_without_suggesting_force(tiny_model, tmp_path):
    src = _copy(tiny_model("mixtral")[0], tmp_path)
    r = cli("convert", src, "-o", src)
    assert (r.returncode, r.stderr) == (1, f"error: the output {src} is one of the command's inputs: give another file\n")


def test_an_output_named_as_a_folder_is_refused_not_written_as_a_file(tiny_model, tmp_path):
    out = f"{tmp_path / 'newdir'}{os.sep}"
    gguf, hf = tiny_model("mixtral")
    for command, src in (("convert", hf), ("export", gguf)):
        r = cli(command, src, "-o", out)
        assert (r.returncode, r.stderr) == (1, f"error: cannot write the output {out}: that names a directory, "
                                               f"not a file\n"), command
    assert list(tmp_path.iterdir()) == []


def test_disk_full_names_the_temporary_files_of_writes_that_were_killed(tiny_model, tmp_path, monkeypatch):
    dead = subprocess.Popen(["true"])
    dead.wait()
    out = tmp_path / "out.gguf"
    stale = tmp_path / f".out.gguf.{dead.pid}.0123abcd.partial"  # create_partial_file's name
    running = tmp_path / f".out.gguf.{os.getpid()}.4567cdef.partial"
    other = tmp_path / f".other.gguf.{dead.pid}.0123abcd.partial"
    for p in (stale, running, other):
        p.write_bytes(b"\0" * 2048)
    full = os.statvfs(tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((*full[:4], 0, *full[5:])))  # f_bavail 0
    with pytest.raises(ConversionError, match=r"^disk full while writing .*; 1 temporary file\(s\) of earlier writes "
                                              r"that did not finish \(their process is gone\) hold 2\.0 KiB: "
                                              rf"{re.escape(str(stale))}; remove them if no other machine is writing "
                                              rf"them$"):
        convert(tiny_model("mixtral")[1], out, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (stale, running, other))


# -- config.json ---------------------------------------------------------------------------------------

def _edited_checkpoint(tiny_model, tmp_path: Path, **changes) -> Path:
    _, hf_dir = tiny_model("mixtral")
    d = tmp_path / "hf"
    shutil.copytree(hf_dir, d)
    config = json.loads((d / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_more_experts_per_token_than_experts_is_refused(tiny_model, tmp_path):
    d = _edited_checkpoint(tiny_model, tmp_path, num_experts_per_tok=9)  # of 4
    with pytest.raises(ConversionError, match="^config.json says 9 experts per token, but the model has 4 experts$"):
        convert(d, tmp_path / "out.gguf", progress=False)
    assert not (tmp_path / "out.gguf").exists()


def test_all_experts_per_token_is_taken(tiny_model, tmp_path):
    d = _edited_checkpoint(tiny_model, tmp_path, num_experts_per_tok=4)
    plan = convert(d, tmp_path / "out.gguf", dry_run=True, progress=False)
    assert plan.architecture == "llama"


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


def test_rope_scaling_that_contradicts_rope_parameters_is_refused(tiny_model, tmp_path):
    # transformers 5 (and so llama.cpp's converter) would take the YaRN scaling with Mixtral's default
    # rope_theta, not the file's
    d = _edited_checkpoint(tiny_model, tmp_path, rope_scaling=YARN)
    with pytest.raises(ConversionError, match=r"^config.json has rope_scaling .*'yarn'.* beside rope_parameters "
                                              r".*, and they disagree; .* move the scaling into rope_parameters"):
        convert(d, tmp_path / "out.gguf", progress=False)


def test_rope_scaling_alone_or_agreeing_with_rope_parameters_is_written(tiny_model, tmp_path):
    for n, rope in enumerate([{"rope_scaling": YARN, "rope_parameters": None, "rope_theta": 1e6},
                              {"rope_scaling": {"rope_type": "yarn", "factor": 4.0},
                               "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                   "original_max_position_embeddings": 128}}]):
        d = _edited_checkpoint(tiny_model, tmp_path / str(n), **rope)
        out = convert(d, tmp_path / f"out{n}.gguf", high="f32", low="f16", progress=False)
        kv = read_model_info(out).metadata
        assert (kv["llama.rope.scaling.type"], kv["llama.rope.scaling.factor"],
                kv["llama.rope.scaling.original_context_length"], kv["llama.rope.freq_base"]) == ("yarn", 4.0, 128, 1e6)


# -- SIGTERM -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])  # (SIGHUP: the terminal closed; it left the file)
def test_sigterm_or_sighup_while_writing_leaves_no_file_and_exits_as_the_signal(tmp_path, sig):
    script = textwrap.dedent(f"""
        import os, signal, sys
        import numpy as np
        from pyedgemoe.convert.gguf_out import GGUFOutput

        signal.signal({int(sig)}, signal.SIG_DFL)  # as in a terminal (a test run under nohup ignores SIGHUP)

        def produce():  # as `timeout`, `docker stop` or a closed ssh session would, half-way through
            os.kill(os.getpid(), {int(sig)})
            return np.zeros(8, dtype=np.float32)

        out = GGUFOutput(sys.argv[1], arch="llama")
        out.add_tensor("a.weight", [8], "f32", produce)
        out.finish(progress=False)
    """)
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "out.gguf")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 128 + sig, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_sigterm_handling_is_only_borrowed_while_writing(tiny_model, tmp_path):
    src, _ = tiny_model("mixtral")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    export(src, tmp_path / "out.gguf", progress=False)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def own(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, own)
    try:
        convert_gguf(src, tmp_path / "out.mp.gguf", high="f32", low="f16", progress=False)
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- edgemoe.low_type ----------------------------------------------------------------------------------

def test_low_type_names_the_type_of_most_low_bytes_after_fallbacks(tiny_model, tmp_path):
    # rows of 64 (gate, up) fall back from q4_K to q5_0, rows of 48 (down) to f16, which holds more bytes
    _, hf_dir = tiny_model("mixtral")
    out = convert(hf_dir, tmp_path / "out.gguf", high="q8_0", low="q4_K", progress=False)
    low_bytes: dict[str, int] = {}
    for t in gguf.GGUFReader(out).tensors:
        if is_low_copy(t.name):
            name = gguf.GGMLQuantizationType(t.tensor_type).name.lower()
            low_bytes[name] = low_bytes.get(name, 0) + int(t.n_bytes)
    assert set(low_bytes) == {"q5_0", "f16"} and low_bytes["f16"] > low_bytes["q5_0"]
    info = read_model_info(out)
    assert info.metadata[LOW_TYPE_KEY] == info.low_type == "f16"


def test_a_low_copy_a_fallback_makes_larger_than_its_high_copy_is_refused(tiny_model, tmp_path):
    # rows of 64 and 32 fill q4_0 blocks but not q4_K's: LOW falls back to q5_0, 5.5 bits to HIGH's 4.5
    _, hf_dir = tiny_model("qwen3_moe")
    with pytest.raises(ConversionError, match=r"^blk\.0\.ffn_\w+_exps\.weight's LOW copy q5_0 \(5\.5 bits per weight\) "
                                              r"is larger than its HIGH copy q4_0 \(4\.5\): LOW is the smaller copy, "
                                              r"read for unimportant misses \(q5_0 instead of q4_K: rows of \d+ do not "
                                              r"fill q4_K blocks\)$"):
        convert(hf_dir, tmp_path / "out.gguf", high="q4_0", low="q4_K", dry_run=True, progress=False)


def test_the_summary_line_names_the_types_written(tiny_model, tmp_path, capsys):
    _, hf_dir = tiny_model("qwen3_moe")
    convert(hf_dir, tmp_path / "out.gguf", high="q8_0", low="q4_K", progress=True)
    summary = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("converting "))
    assert ": experts q8_0 " in summary and " + q5_0 " in summary and "q4_K" not in summary, summary
