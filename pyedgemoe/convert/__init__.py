"""Conversion to the multi-precision GGUF of docs/format.md.

    from pyedgemoe.convert import convert
    convert("./Qwen3-30B-A3B", "qwen3.mp.gguf", high="q8_0", low="q4_K")   # HF checkpoint directory
    convert("Qwen/Qwen3-30B-A3B", "qwen3.mp.gguf")                          # HF repo id (downloaded)
    convert("qwen3-q8_0.gguf", "qwen3.mp.gguf", low_from="qwen3-q4_k_m.gguf")  # standard GGUF(s)
    print(convert("./Qwen3-30B-A3B", "x.gguf", dry_run=True))               # the plan, nothing written
"""
from __future__ import annotations

import os
from pathlib import Path

from pyedgemoe.convert.plan import DEFAULT_HIGH, Plan
from pyedgemoe.errors import ConversionError

__all__ = ["convert", "Plan", "SUPPORTED_ARCHITECTURES", "ConversionError"]

# Files a conversion needs from a Hugging Face repo (weights in safetensors only).
HF_ALLOW_PATTERNS = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
                     "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                     "chat_template.json", "chat_template.jinja", "generation_config.json", "README.md"]


def __getattr__(name: str):
    if name == "SUPPORTED_ARCHITECTURES":
        from pyedgemoe.convert.from_hf import SUPPORTED_ARCHITECTURES
        return SUPPORTED_ARCHITECTURES
    raise AttributeError(name)


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def convert(src: str | os.PathLike, out: str | os.PathLike, *, high: str = DEFAULT_HIGH, low: str | None = None,
            base: str | None = None, low_from: str | os.PathLike | None = None, force: bool = False,
            dry_run: bool = False, progress: bool = True, n_threads: int | None = None,
            calibration: str | os.PathLike | dict | None = None, name: str | None = None) -> Path | Plan:
    """Convert `src` into the multi-precision GGUF `out`; return `out`, or the Plan if dry_run.

    src: a Hugging Face model directory (config.json + safetensors + tokenizer files), a standard
    llama.cpp GGUF, or a Hugging Face repo id ("org/name", downloaded with huggingface_hub).
    high, low: ggml types of the routed experts' two copies; base: type of the other weight
    matrices (HF: default as llama.cpp's `--outtype auto`, bf16 for a BF16 checkpoint, else f16;
    GGUF: default the source's). low_from: GGUF sources only, a lower
    quant of the same model whose experts become the LOW copies. calibration: a `pyedgemoe
    calibrate` sidecar (path or contents) to embed as `edgemoe.calibration.*` metadata, which the
    runtime uses when the model has no sidecar of its own. name: the model's name (general.name;
    default: a GGUF source's, else the checkpoint's model card or config, else out's file name, or
    the repo id). Every failure a user can cause is a
    ConversionError, and no file is left under `out` unless the conversion succeeds.
    """
    from pyedgemoe.convert import from_hf
    from pyedgemoe.convert.gguf_out import output_path
    from pyedgemoe.load_plan import MAX_THREADS

    if n_threads is not None and (isinstance(n_threads, bool) or not isinstance(n_threads, int)
                                  or not 1 <= n_threads <= MAX_THREADS):
        raise ConversionError(f"--threads must be an integer in 1..{MAX_THREADS}, got {n_threads!r}")
    if name is not None and (not isinstance(name, str) or not name.strip() or not name.isprintable()):
        raise ConversionError(f"--name must be a name on one line, without control characters, got {name!r}")
    # the sidecar is read here, before the source's inputs are known: the output may not replace it
    read = [calibration] if isinstance(calibration, (str, os.PathLike)) and not dry_run else []
    calibration = _read_calibration(calibration)
    out = output_path(out, read)

    path = Path(src)
    if path.is_dir():
        if low_from is not None:
            raise ConversionError("--low-from takes the LOW experts from a GGUF; it applies to GGUF sources only")
        if not (path / "config.json").is_file():
            raise ConversionError(f"{path} has no config.json: not a Hugging Face model directory")
        return from_hf.convert_hf(path, out, high=high, low=low, base=base, force=force, dry_run=dry_run,
                                  progress=progress, n_threads=n_threads, calibration=calibration, model_name=name)
    if path.is_file():
        if not _is_gguf(path):
            raise ConversionError(f"{path} is neither a GGUF file nor a Hugging Face model directory")
        from pyedgemoe.convert import from_gguf
        result = from_gguf.convert_gguf(path, Path(out), high=high, low=low, base=base,
                                        low_from=Path(low_from) if low_from is not None else None,
                                        force=force, dry_run=dry_run, progress=progress, n_threads=n_threads,
                                        calibration=calibration, name=name)
        return Plan.from_dict(result) if isinstance(result, dict) else result
    if path.exists():  # a FIFO, a device: never opened (reading one may block or never end)
        raise ConversionError(f"not a file or directory: {path}")
    if from_hf.looks_like_repo_id(str(src)):
        if low_from is not None:
            raise ConversionError("--low-from applies to GGUF sources only")
        local = download(str(src))
        return from_hf.convert_hf(local, out, high=high, low=low, base=base, force=force, dry_run=dry_run,
                                  progress=progress, n_threads=n_threads, source_label=str(src),
                                  model_name=name or str(src), calibration=calibration)
    raise ConversionError(f"{src} not found (expected a Hugging Face model directory, a GGUF file, "
                          f"or a Hugging Face repo id like Qwen/Qwen3-30B-A3B)")


def _read_calibration(calibration) -> dict | None:
    """A calibration sidecar's contents from its path (or checked contents), as a ConversionError if bad."""
    from pyedgemoe.calibration.sidecar import check_calibration, read_sidecar
    from pyedgemoe.errors import InvalidOptionError

    if calibration is None:
        return None
    try:
        if isinstance(calibration, dict):
            return check_calibration(calibration)
        return read_sidecar(calibration)
    except InvalidOptionError as e:
        raise ConversionError(str(e)) from None


def download(repo_id: str) -> Path:
    """The local snapshot of `repo_id` (only the files a conversion reads), fetched if needed."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConversionError(f"downloading {repo_id} needs huggingface_hub (pip install huggingface_hub); "
                              f"or download the checkpoint yourself and pass its directory") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HF_ALLOW_PATTERNS))
    except KeyboardInterrupt:
        raise
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConversionError(
            f"cannot fetch {repo_id} from Hugging Face ({type(e).__name__}: {reason}); if you are offline or "
            f"the repo is gated, download the checkpoint first (huggingface-cli download {repo_id} "
            f"--local-dir DIR) and pass the directory") from None
