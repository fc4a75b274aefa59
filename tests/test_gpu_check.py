"""The GPU check's own checks (scripts/gpu_check.sh, docs/gpu.md): on a machine that cannot run it,
it stops in seconds with one `error:` line that says why, before any time on a lent GPU is spent.
(The check itself runs end to end in `make gpu-rehearse`, on lavapipe.)"""
from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def stamp() -> str:
    return subprocess.run([REPO / "scripts" / "native_stamp.sh"], capture_output=True, text=True,
                          check=True).stdout.strip()


def make_kit(path: Path, stamp_text: str, libs: dict[str, Path] = {}) -> Path:
    """A kit tarball holding a STAMP and the given libraries (name -> file)."""
    with tarfile.open(path, "w:xz") as tar:
        data = (stamp_text + "\n").encode()
        info = tarfile.TarInfo("STAMP")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for name, file in libs.items():
            tar.add(file, arcname=f"lib/{name}")
    return path


def run(tmp_path: Path, *args: str, fake_gpu: bool = True, **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if fake_gpu:  # the driver's tool, as on a GPU machine
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
        smi.chmod(0o755)
    path = f"{bin_dir}:/usr/bin:/bin"
    return subprocess.run([SCRIPT, str(tmp_path / "out"), *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": path, "HOME": os.environ.get("HOME", "/root"), "TMPDIR": str(tmp_path), **env})


def assert_error(p: subprocess.CompletedProcess, message: str) -> None:
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], p.stderr


def test_no_gpu_driver(tmp_path):
    assert_error(run(tmp_path, fake_gpu=False), "nvidia-smi not found")


def test_no_kit(tmp_path):
    assert_error(run(tmp_path, GPU_KIT=str(tmp_path / "none.tar.xz")), "no kit at")


def test_a_stale_kit(tmp_path):
    kit = make_kit(tmp_path / "kit.tar.xz", "0123456789abcdef")
    assert_error(run(tmp_path, GPU_KIT=str(kit)), f"stale kit: built from other native sources (kit 0123456789abcdef, tree {stamp()})")


def test_missing_cuda_libraries(tmp_path):
    # a Python whose site-packages hold no NVIDIA wheels, and no CUDA toolkit at /usr/local/cuda
    if Path("/usr/local/cuda/lib64/libcublas.so.13").exists():
        pytest.skip("this machine has cuBLAS in /usr/local/cuda")
    kit = make_kit(tmp_path / "kit.tar.xz", stamp())
    assert_error(run(tmp_path, GPU_KIT=str(kit)), "CUDA library libcu")


def test_a_kit_library_that_needs_what_the_machine_lacks(tmp_path):
    # a library linked against one that is not on this machine (--rehearse: no CUDA libraries asked for)
    src = tmp_path / "x.c"
    src.write_text("int f(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", tmp_path / "libgone.so", src], check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", tmp_path / "libggml-x.so", src, "-Wl,--no-as-needed",
                    f"-L{tmp_path}", "-lgone"], check=True)
    kit = make_kit(tmp_path / "kit.tar.xz", stamp(), {"libggml-x.so": tmp_path / "libggml-x.so"})
    assert_error(run(tmp_path, "--rehearse", GPU_KIT=str(kit)), "libgone.so => not found")


def load_gpu_check():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_report_says_what_our_hook_costs_a_token_with_every_expert_cached():
    # stock -ngl 99 at 250 tok/s (4.0 ms a token) and ours `gpu` at 100 % at 200 (5.0 ms): the hook
    # costs 1.0 ms a token beyond it; the 25 % comparison leaves both 100 % cells out; a cell with a
    # prefetcher says what became of its prefetches
    check = load_gpu_check()

    def cell(engine, label, budget, decode_tps, **extra):
        return dict(model="qwen3", engine=engine, label=label, budget=budget, decode_tps=decode_tps, ttft_s=0.1,
                    prefill_tps=1000.0, **extra)
    ours = dict(hit_rate=1.0, chosen_mode="gpu", decode_per_token=dict(ms=5.0, op_ms=0.4, bytes_uploaded=0, upload_ms=0,
                                                                       load_ms=0, stall_ms=0.4))
    result = dict(device=dict(description="GPU", name="CUDA0"), sizes=dict(prefill=512, decode=64, repeats=3),
                  rehearsal=False, date="today", threads=16, numa={}, correctness=None, skipped=[],
                  models=dict(qwen3=dict(geometry="qwen3-30b-a3b", layers=48, type="q4_k", bytes=17e9)),
                  cells=[cell("pyedgemoe", "gpu", "25%", 30.0, **{**ours, "hit_rate": 0.3}),
                         cell("llama.cpp", "-ot exps=CPU", "25%", 40.0),
                         cell("llama.cpp", "-ngl 99", "100%", 250.0),
                         cell("pyedgemoe", "gpu", "100%", 200.0, **ours),
                         cell("pyedgemoe", "gpu, prefetch hobbit", "25%", 31.0, **{**ours, "hit_rate": 0.4},
                              prefetches=dict(issued=90, used=70, given_back=12, stopped=False))])
    text = check.report(result)
    assert "prefetch: 90 read ahead, 70 used, 12 not begun by their layer |" in text
    assert ("- qwen3, every expert in our `gpu` cache (no miss): 200.0 tok/s, 5.0 ms a token, +1.0 ms beside `-ngl 99`: "
            "what our hook costs a token (our op 0.4 ms of it)") in text
    assert "- qwen3 at 25%: our best decode (`gpu, prefetch hobbit`) / stock's best (`-ot exps=CPU`) = 0.78x" in text
    assert "every expert on the GPU (llama.cpp `-ngl 99`): 250.0 tok/s, 4.0 ms a token" in text


def bench_cells(monkeypatch, tmp_path, *argv: str) -> list[tuple[str, list[str]]]:
    """The benchmark's cells (label, a child's or llama-bench's arguments) that gpu_check.py with
    argv would run on a 48-layer Qwen3 file already written; nothing is run."""
    check = load_gpu_check()
    ran = []
    monkeypatch.setattr(check.Check, "cell", lambda self, name, budget, label, args, stock=False: ran.append((label, args)))

    def bench_only(self):
        self.result["models"]["qwen3"] = dict(path="q.gguf", layers=48, low_path="q2.gguf")  # low_path: with --low
        self.bench()
        return 0
    monkeypatch.setattr(check.Check, "run", bench_only)
    monkeypatch.setattr("sys.argv", ["gpu_check.py", "--kit", str(tmp_path), "--out", str(tmp_path / "out"),
                                     "--models", "qwen3", "--budgets", "25%", *argv])
    assert check.main() == 0
    return ran


def assert_refused(monkeypatch, *argv: str) -> None:
    monkeypatch.setattr("sys.argv", ["gpu_check.py", "--kit", "k", "--out", "o", *argv])
    with pytest.raises(SystemExit) as e:
        load_gpu_check().main()
    assert e.value.code == 2


def test_split_at_fixed_shares_is_measured_beside_the_share_its_rates_give(tmp_path, monkeypatch):
    # `--link-shares 0.3 0.7` adds `split` cells at those shares; a share outside 0-1 is refused
    ran = bench_cells(monkeypatch, tmp_path, "--modes", "split", "--link-shares", "0.3", "0.7")
    split = [(label, a[a.index("--link-share") + 1] if "--link-share" in a else None) for label, a in ran if "split" in label]
    assert split == [("split", None), ("split 0.3", "0.3"), ("split 0.7", "0.7")]
    assert_refused(monkeypatch, "--link-shares", "1.5")


def test_split_with_fewer_threads_is_measured_beside_it(tmp_path, monkeypatch):
    # `--split-threads 15` adds a `split` cell whose own thread count (the last --threads a child
    # gets) is 15, the others' stays; a count below 1 is refused
    ran = bench_cells(monkeypatch, tmp_path, "--threads", "16", "--modes", "split", "--split-threads", "15")
    threads = {label: int(a[len(a) - 1 - a[::-1].index("--threads") + 1]) for label, a in ran if "split" in label}
    assert threads == {"split": 16, "split, 15 threads": 15}
    assert_refused(monkeypatch, "--split-threads", "0")


def test_each_mode_with_a_prefetcher_is_measured_beside_it(tmp_path, monkeypatch):
    # `--prefetch hobbit` adds each of --modes with that prefetcher (the child's --prefetch), the
    # other cells keep none; a prefetcher the runtime does not have is refused
    ran = bench_cells(monkeypatch, tmp_path, "--modes", "gpu", "split", "--prefetch", "hobbit")
    prefetch = {label: a[a.index("--prefetch") + 1] if "--prefetch" in a else None
                for label, a in ran if not label.startswith("-")}
    assert prefetch == {"gpu": None, "split": None, "gpu, prefetch hobbit": "hobbit", "split, prefetch hobbit": "hobbit"}
    assert_refused(monkeypatch, "--prefetch", "sometimes")


def test_each_mode_with_mixed_precision_is_measured_beside_it_and_kept_out_of_the_lossless_ratio(tmp_path, monkeypatch):
    # `--low q2_k` adds each of --modes with LOW copies from the model's q2_k file (the child's
    # --low-from); the report gives its LOW selections and top-1 agreement with the lossless cell of
    # its mode, and its ratio to stock apart from the lossless one; a type not offered is refused
    ran = bench_cells(monkeypatch, tmp_path, "--modes", "split", "--low", "q2_k")
    low = {label: a[a.index("--low-from") + 1] if "--low-from" in a else None for label, a in ran if "split" in label}
    assert low == {"split": None, "split, low q2_k": "q2.gguf"}
    assert_refused(monkeypatch, "--low", "q8_0")

    check = load_gpu_check()

    def cell(label, decode_tps, picks, **extra):
        return dict(model="qwen3", engine="pyedgemoe", label=label, mode="split", chosen_mode="split", budget="25%",
                    decode_tps=decode_tps, ttft_s=0.1, prefill_tps=1000.0, hit_rate=0.3, picks=picks, **extra)
    per_token = dict(ms=20.0, op_ms=1.0, bytes_uploaded=0, upload_ms=0, load_ms=0, stall_ms=0, uploads=0, cpu_experts=0)
    result = dict(device=dict(description="GPU", name="CUDA0"), sizes=dict(prefill=512, decode=64, repeats=3),
                  rehearsal=False, date="today", threads=16, numa={}, correctness=None, skipped=[],
                  models=dict(qwen3=dict(geometry="qwen3-30b-a3b", layers=48, type="q4_k", bytes=17e9)),
                  cells=[cell("split", 40.0, [1, 2, 3, 4], decode_per_token=per_token),
                         dict(model="qwen3", engine="llama.cpp", label="-ot exps=CPU", budget="25%", decode_tps=50.0,
                              ttft_s=0.1, prefill_tps=500.0),
                         cell("split, low q2_k", 80.0, [1, 2, 9, 4], lossy=True,
                              decode_per_token=dict(per_token, selections_low=120.0, skipped=30.0))])
    text = check.report(result)
    assert "a token 120 selections LOW, 30 skipped; top-1 agreement with `split` 75%" in text
    assert "- qwen3 at 25%: our best decode (`split`) / stock's best (`-ot exps=CPU`) = 0.80x" in text
    assert "- qwen3 at 25%, mixed precision (lossy): `split, low q2_k` / stock's best = 1.60x" in text
