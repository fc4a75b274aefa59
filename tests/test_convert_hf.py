"""`pyedgemoe.convert` from Hugging Face checkpoints (issue 3).

References are independent of our converter: transformers' logits for the same checkpoint, and
the GGUF llama.cpp's own convert_hf_to_gguf.py writes for it (the `tiny_model` fixture; for
Phi-MoE, which tiny_moe.py leaves out, a tiny checkpoint built here). Conversions are cached per
module; every checkpoint is tiny, so the whole file runs in about a minute on 2 cores.
"""
from __future__ import annotations

import fcntl
import inspect
import io
import json
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import MODELS_DIR, MOE_ARCHITECTURES, tiny_moe
from pyedgemoe import ConversionError, Engine
from pyedgemoe.convert import Plan, convert
from pyedgemoe.convert.plan import fitting_type
from pyedgemoe.convert.hf_checkpoint import HFCheckpoint
from pyedgemoe.gguf_format import (
    FORMAT_VERSION_KEY,
    HIGH_TYPE_KEY,
    KEY_PREFIX,
    LOW_TYPE_KEY,
    PROVENANCE_KEY,
    expert_tensor_name,
    is_expert_tensor,
    is_low_copy,
    low_copy_name,
)

SETTINGS = dict(n_ctx=256, n_threads=2, flash_attn=False, kv_type="f32")
IDS = [1, 17, 42, 99, 5, 230, 64, 7, 150, 33, 12, 201, 88, 3, 120, 45]
# q8_0 experts plus an f16 base move these tiny models' logits by ~0.03-0.08 per position
# (measured; a router flipping to another expert moves one position more). Greedy tokens may
# differ from transformers' only where its top-2 logits are closer than this.
QUANT_NOISE = 0.15


def read(path) -> gguf.GGUFReader:
    return gguf.GGUFReader(str(path))


def kv(reader: gguf.GGUFReader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def dir_listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("convert_hf")


@pytest.fixture(scope="module")
def converted(tiny_model, out_dir):
    """converted(arch, kind) -> path; kind "f32" (all f32, LOW q4_0) or "q8_0" (defaults)."""
    cache: dict = {}

    def get(arch: str, kind: str) -> Path:
        if (arch, kind) not in cache:
            _, hf_dir = tiny_model(arch)
            out = out_dir / f"{arch}-{kind}.gguf"
            if kind == "f32":
                convert(hf_dir, out, high="f32", low="q4_0", base="f32", progress=False)
            else:
                convert(hf_dir, out, high="q8_0", progress=False)
            cache[arch, kind] = out
        return cache[arch, kind]
    return get


# A tiny Phi-MoE checkpoint (transformers' PhimoeForCausalLM with a SentencePiece tokenizer) and
# llama.cpp's conversion of it, cached under tests/.models/phimoe like tiny_moe.py's models.
SPM_SPECIALS = ["<|user|>", "<|assistant|>", "<|end|>"]


def train_sentencepiece(vocab_size: int = 384) -> bytes:
    import sentencepiece as spm
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(tiny_moe.training_text()), model_writer=buf, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, user_defined_symbols=SPM_SPECIALS, minloglevel=2,
        # as real Llama/Mixtral/Phi tokenizer.model files: no normalization, whitespace kept
        normalization_rule_name="identity", remove_extra_whitespaces=False)
    return buf.getvalue()


def write_spm_tokenizer(hf_dir: Path) -> None:
    """tokenizer.model + a LlamaTokenizer-style tokenizer_config.json (BOS added, no EOS)."""
    (hf_dir / "tokenizer.model").write_bytes(train_sentencepiece())
    (hf_dir / "tokenizer.json").unlink(missing_ok=True)
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False, "chat_template": tiny_moe.CHAT_TEMPLATE}))


def build_phimoe(hf_dir: Path, overrides: dict | None = None) -> None:
    """A tiny Phi-MoE checkpoint in hf_dir; `overrides` replaces config arguments (attention_bias, ...)."""
    import torch
    import transformers
    hf_dir.mkdir(parents=True)
    write_spm_tokenizer(hf_dir)
    config = transformers.PhimoeConfig(**{
        **dict(vocab_size=384, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
               initializer_range=tiny_moe.INIT_STD, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
               rope_parameters={"rope_type": "default", "rope_theta": 1e4}, attention_bias=True, lm_head_bias=True),
        **(overrides or {})})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tiny_moe._randomise_(model, 0)
    model.save_pretrained(str(hf_dir))
    cfg = json.loads((hf_dir / "config.json").read_text())
    # llama.cpp knows the remote-code class name, and its Phi-3 code needs the original context
    cfg.update(architectures=["PhiMoEForCausalLM"], original_max_position_embeddings=512)
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="session")
def phimoe_model() -> tuple[Path, Path]:
    """(llama.cpp's f32 GGUF, HF dir) of a tiny Phi-MoE, rebuilt when this file or the converter changes."""
    arch_dir = MODELS_DIR / "phimoe"
    arch_dir.mkdir(parents=True, exist_ok=True)
    hf_dir, ref = arch_dir / "hf", arch_dir / "phimoe-f32.gguf"
    builder = [inspect.getsource(f) for f in (train_sentencepiece, write_spm_tokenizer, build_phimoe)]
    key = tiny_moe._sha256([*builder, Path(tiny_moe.__file__).read_bytes(),
                            *(p.read_bytes() for p in tiny_moe._converter_sources())])
    stamp = arch_dir / "stamp"
    with open(arch_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (stamp.is_file() and stamp.read_text() == key and ref.is_file()):
            shutil.rmtree(hf_dir, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix="hf.", dir=arch_dir))
            shutil.rmtree(tmp)
            build_phimoe(tmp)
            os.replace(tmp, hf_dir)
            tiny_moe.convert_to_gguf(hf_dir, ref, "f32", model_name="tiny-phimoe")
            stamp.write_text(key)
    return ref, hf_dir


# ---------------------------------------------------------------------------------------------
# synthetic checkpoints written straight to safetensors (for shapes tiny models cannot have)


SAFETENSORS_DTYPE = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype_names: dict[str, str] | None = None) -> None:
    """A safetensors file; dtype_names overrides the header dtype of some tensors (raw bytes kept)."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        dtype = (dtype_names or {}).get(name) or SAFETENSORS_DTYPE[a.dtype]
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        blobs.append(a.tobytes())
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for b in blobs:
            f.write(b)


def qwen3_moe_tensors(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    h, hd, v = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    nh, nkv, ff, e = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["moe_intermediate_size"], cfg["num_experts"]

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.1).astype(np.float32)
    t = {"model.embed_tokens.weight": w(v, h), "lm_head.weight": w(v, h), "model.norm.weight": 1 + w(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + w(h), p + "post_attention_layernorm.weight": 1 + w(h),
                  p + "self_attn.q_proj.weight": w(nh * hd, h), p + "self_attn.k_proj.weight": w(nkv * hd, h),
                  p + "self_attn.v_proj.weight": w(nkv * hd, h), p + "self_attn.o_proj.weight": w(h, nh * hd),
                  p + "self_attn.q_norm.weight": 1 + w(hd), p + "self_attn.k_norm.weight": 1 + w(hd),
                  p + "mlp.gate.weight": w(e, h)})
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            t.update({q + "gate_proj.weight": w(ff, h), q + "up_proj.weight": w(ff, h), q + "down_proj.weight": w(h, ff)})
    return t


@pytest.fixture(scope="module")
def wide_qwen3(tiny_model, out_dir) -> Path:
    """A qwen3_moe checkpoint whose rows are multiples of 256, so every type fits without fallback."""
    _, tiny = tiny_model("qwen3_moe")
    d = out_dir / "wide-qwen3-hf"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
               moe_intermediate_size=256, num_experts=4, num_local_experts=4, num_hidden_layers=2)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").unlink()
    write_safetensors(d / "model.safetensors", qwen3_moe_tensors({**cfg, "num_experts": 4}, np.random.default_rng(0)))
    return d


def broken_copy(tiny_model, tmp_path: Path, arch: str = "qwen3_moe") -> Path:
    _, hf_dir = tiny_model(arch)
    d = tmp_path / "hf"
    shutil.copytree(hf_dir, d)
    return d


# ---------------------------------------------------------------------------------------------
# correctness against transformers


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_f32_conversion_gives_transformers_logits(converted, tiny_model, arch):
    _, hf_dir = tiny_model(arch)
    with Engine(converted(arch, "f32"), **SETTINGS) as eng:
        ours = eng.logits(IDS)
    reference = tiny_moe.transformers_logits(hf_dir, IDS)
    assert ours.shape == reference.shape
    assert np.max(np.abs(ours - reference)) <= 1e-3


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_q8_0_greedy_tokens_agree_with_transformers_except_near_ties(converted, tiny_model, arch):
    _, hf_dir = tiny_model(arch)
    prompt = IDS[:8]
    with Engine(converted(arch, "q8_0"), **SETTINGS) as eng:
        ours = eng.time_generation(prompt, 32)["tokens"]
    # transformers on the same sequence: its prediction for each of our 32 steps
    reference = tiny_moe.transformers_logits(hf_dir, prompt + ours[:-1])[len(prompt) - 1:]
    exceptions = 0
    for step, (token, logits) in enumerate(zip(ours, reference)):
        first, second = np.argsort(logits)[::-1][:2]
        if token == first:
            continue
        assert token == second and logits[first] - logits[second] <= QUANT_NOISE, \
            f"step {step}: ours {token}, transformers {first} (gap {logits[first] - logits[token]:.3f})"
        exceptions += 1
    assert exceptions <= 3


# ---------------------------------------------------------------------------------------------
# the multi-precision format


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_every_routed_expert_tensor_has_a_lowbit_copy_in_the_low_type(converted, tiny_model, arch):
    path = converted(arch, "q8_0")
    r = read(path)
    tensors = {t.name: t for t in r.tensors}
    experts = [n for n in tensors if is_expert_tensor(n)]
    copies = [n for n in tensors if is_low_copy(n)]
    assert experts and sorted(copies) == sorted(low_copy_name(n) for n in experts)
    for name in experts:
        hi, lo = tensors[name], tensors[low_copy_name(name)]
        assert list(hi.shape) == list(lo.shape)
        row = int(hi.shape[0])
        # tiny rows (32, 48, 64) cannot hold q4_K's 256-element blocks: llama.cpp's fallback type
        assert ggml_name(hi.tensor_type) == fitting_type("q8_0", row)
        assert ggml_name(lo.tensor_type) == fitting_type("q4_K", row)
    assert not any(("shexp" in n or "gate_inp" in n) and is_low_copy(n) for n in tensors)
    # the HIGH part is exactly llama.cpp's tensor set
    reference = {t.name for t in read(tiny_model(arch)[0]).tensors}
    assert set(tensors) - set(copies) == reference
    assert kv(r, FORMAT_VERSION_KEY) == 1
    # each names the type of most of its precision's bytes (docs/format.md): here a fallback's for LOW
    def most_bytes(names: list[str]) -> str:
        by_type: dict[str, int] = {}
        for n in names:
            by_type[ggml_name(tensors[n].tensor_type)] = by_type.get(ggml_name(tensors[n].tensor_type), 0) \
                + int(tensors[n].n_bytes)
        return max(by_type, key=by_type.get)
    assert (kv(r, HIGH_TYPE_KEY), kv(r, LOW_TYPE_KEY)) == (most_bytes(experts), most_bytes(copies))
    assert kv(r, LOW_TYPE_KEY) != "q4_K"  # no tiny row fills a q4_K block
    provenance = json.loads(kv(r, PROVENANCE_KEY))
    assert provenance["source_type"] == "hf" and provenance["low_from"] is None
    assert provenance["source"] == str(tiny_model(arch)[1])
    assert kv(r, "general.alignment") == 4096
    assert all(t.data_offset % 4096 == 0 for t in r.tensors)


def ggml_name(qtype) -> str:
    from pyedgemoe.convert.gguf_out import ggml_type_name
    return ggml_type_name(qtype)


def test_experts_are_exactly_the_requested_types_when_rows_fit(wide_qwen3, out_dir):
    out = convert(wide_qwen3, out_dir / "wide.gguf", high="q8_0", low="q4_K", progress=False)
    r = read(out)
    experts = [t for t in r.tensors if is_expert_tensor(t.name)]
    copies = [t for t in r.tensors if is_low_copy(t.name)]
    assert len(experts) == len(copies) == 6
    assert {ggml_name(t.tensor_type) for t in experts} == {"q8_0"}
    assert {ggml_name(t.tensor_type) for t in copies} == {"q4_K"}
    with Engine(out, **SETTINGS) as eng:
        assert np.isfinite(eng.logits(IDS[:4])).all()


def test_expert_e_of_a_quantized_stack_is_expert_e_of_the_checkpoint(wide_qwen3, out_dir):
    from pyedgemoe import _native
    out = out_dir / "wide.gguf"
    if not out.exists():
        convert(wide_qwen3, out, progress=False)
    r = read(out)
    tensors = {t.name: t for t in r.tensors}
    with HFCheckpoint(wide_qwen3) as ckpt:
        for projection in ("up", "down"):
            name = expert_tensor_name(1, projection)
            source = np.stack([ckpt.read(f"model.layers.1.mlp.experts.{e}.{projection}_proj.weight")
                               for e in range(4)])
            for copy, tol in ((name, 0.02), (low_copy_name(name), 0.15)):
                t = tensors[copy]
                rows, row_len = source.shape[0] * source.shape[1], source.shape[2]
                got = _native.dequantize(np.asarray(t.data).reshape(-1).view(np.uint8), ggml_name(t.tensor_type),
                                         rows, row_len).reshape(source.shape)
                assert np.max(np.abs(got - source)) <= tol * np.max(np.abs(source))


# ---------------------------------------------------------------------------------------------
# against llama.cpp's converter


def assert_same_as_llama_cpp(ours_path: Path, reference_path: Path) -> None:
    """The HIGH part of our file (no .lowbit tensors, no edgemoe.* keys) equals llama.cpp's file:
    same tensors in the same order, shapes, types and bytes, and the same metadata (tokenizer
    included) except general.name, which llama.cpp was given on its command line."""
    ours, ref = read(ours_path), read(reference_path)
    ours_t = [t for t in ours.tensors if not is_low_copy(t.name)]
    assert [t.name for t in ours_t] == [t.name for t in ref.tensors]
    for a, b in zip(ours_t, ref.tensors):
        assert list(a.shape) == list(b.shape), a.name
        assert a.tensor_type == b.tensor_type, a.name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name
    skip = ("general.name", "general.alignment")
    ours_kv = {k: f.contents() for k, f in ours.fields.items()
               if not k.startswith(("GGUF.", KEY_PREFIX)) and k not in skip}
    ref_kv = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.") and k not in skip}
    assert ours_kv.keys() == ref_kv.keys()
    for k in ref_kv:
        assert ours_kv[k] == ref_kv[k], k
    assert ours_kv["tokenizer.ggml.tokens"] == ref_kv["tokenizer.ggml.tokens"]


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_f32_conversion_equals_llama_cpp_converter(converted, tiny_model, arch):
    assert_same_as_llama_cpp(converted(arch, "f32"), tiny_model(arch)[0])


def test_phimoe_f32_conversion_equals_llama_cpp_converter_and_runs(phimoe_model, out_dir):
    reference, hf_dir = phimoe_model
    out = convert(hf_dir, out_dir / "phimoe-f32.gguf", high="f32", low="q4_0", base="f32", progress=False)
    assert_same_as_llama_cpp(out, reference)
    with Engine(out, **SETTINGS) as eng:
        ours = eng.logits(IDS)
    with Engine(reference, **SETTINGS) as eng:
        theirs = eng.logits(IDS)
    assert np.array_equal(ours, theirs)
    assert {t.name for t in read(out).tensors if is_low_copy(t.name)} == \
        {low_copy_name(t.name) for t in read(reference).tensors if is_expert_tensor(t.name)}


# ---------------------------------------------------------------------------------------------
# tokenizers: llama.cpp's tokenizer on our file reproduces Hugging Face's ids

TEXTS = ["Hello world! The experts run fast.", "  two  spaces, tabs\tand\nnewlines 12345 67",
         "don't (stop) 'here' -- café, naïve; 3.14?", "<|im_start|>user\nwhat is a token?<|im_end|>"]


def test_bpe_token_ids_equal_hugging_face(converted, tiny_model):
    from tokenizers import Tokenizer
    _, hf_dir = tiny_model("qwen3_moe")
    hf = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    with Engine(converted("qwen3_moe", "q8_0"), **SETTINGS) as eng:
        for text in TEXTS:
            assert eng.tokenize(text, add_bos=True, special=True) == hf.encode(text).ids, text
    assert kv(read(converted("qwen3_moe", "q8_0")), "tokenizer.ggml.pre") == "gpt-2"


def test_sentencepiece_token_ids_equal_hugging_face(phimoe_model, out_dir):
    import sentencepiece as spm
    _, hf_dir = phimoe_model
    sp = spm.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    out = out_dir / "phimoe-f32.gguf"
    if not out.exists():
        convert(hf_dir, out, high="f32", low="q4_0", base="f32", progress=False)
    with Engine(out, **SETTINGS) as eng:
        for text in TEXTS[:3]:
            assert eng.tokenize(text, add_bos=True) == [sp.bos_id()] + sp.encode(text), text


def test_mixtral_with_tokenizer_model_gets_the_sentencepiece_vocab(tiny_model, tmp_path):
    import sentencepiece as spm
    d = broken_copy(tiny_model, tmp_path, "mixtral")
    write_spm_tokenizer(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(bos_token_id=1, eos_token_id=2, pad_token_id=None)  # the ids of <s>, </s>
    (d / "config.json").write_text(json.dumps(cfg))
    out = convert(d, tmp_path / "m.gguf", high="f32", low="q4_0", base="f32", progress=False)
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    r = read(out)
    assert kv(r, "tokenizer.ggml.model") == "llama"
    assert kv(r, "tokenizer.ggml.tokens") == [sp.id_to_piece(i) for i in range(sp.vocab_size())]
    assert kv(r, "tokenizer.ggml.scores") == pytest.approx([sp.get_score(i) for i in range(sp.vocab_size())])
    with Engine(out, **SETTINGS) as eng:
        for text in TEXTS[:3]:
            assert eng.tokenize(text, add_bos=True) == [sp.bos_id()] + sp.encode(text), text


# ---------------------------------------------------------------------------------------------
# dry run, overwrite, checkpoint layouts


def test_dry_run_returns_the_plan_and_writes_nothing(converted, tiny_model, out_dir):
    _, hf_dir = tiny_model("deepseek_v2")
    out = out_dir / "never-written.gguf"
    plan = convert(hf_dir, out, dry_run=True)
    assert isinstance(plan, Plan) and not out.exists()
    assert not list(out_dir.glob(".never-written*"))
    written = {t.name: t for t in read(converted("deepseek_v2", "q8_0")).tensors}
    assert [t.name for t in plan.tensors] == list(written)
    for t in plan.tensors:
        assert t.nbytes == int(written[t.name].n_bytes) and t.type == ggml_name(written[t.name].tensor_type)
    b = plan.bytes_by_role()
    assert b["high"] > b["low"] > 0 and b["base"] > 0
    assert plan.total_bytes == sum(b.values())
    text = plan.format()
    assert low_copy_name(expert_tensor_name(1, "up")) in text and "total" in text


def test_a_gguf_source_goes_to_the_gguf_converter(tiny_model, tmp_path):
    gguf_path, hf_dir = tiny_model("olmoe")
    plan = convert(gguf_path, tmp_path / "g.gguf", low="q4_0", dry_run=True)
    assert isinstance(plan, Plan) and plan.architecture == "olmoe"
    assert {t.role for t in plan.tensors} == {"base", "high", "low"}
    assert_fails_cleanly(hf_dir, tmp_path, "GGUF sources only", low_from=gguf_path)


def test_refuses_to_overwrite_without_force(tiny_model, tmp_path):
    _, hf_dir = tiny_model("olmoe")
    out = tmp_path / "o.gguf"
    out.write_bytes(b"precious")
    with pytest.raises(ConversionError, match="exists"):
        convert(hf_dir, out, progress=False)
    assert out.read_bytes() == b"precious"
    convert(hf_dir, out, force=True, progress=False)
    assert out.read_bytes()[:4] == b"GGUF"
    assert dir_listing(tmp_path) == ["o.gguf"]


def test_fused_expert_checkpoint_converts_like_per_expert_one(converted, tiny_model, tmp_path):
    d = broken_copy(tiny_model, tmp_path, "qwen3_moe")
    with HFCheckpoint(d) as ckpt:
        tensors = {n: ckpt.read(n) for n in ckpt.names() if ".experts." not in n}
        for i in range(2):
            e = [f"model.layers.{i}.mlp.experts.{x}." for x in range(8)]
            tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack(
                [np.concatenate([ckpt.read(p + "gate_proj.weight"), ckpt.read(p + "up_proj.weight")]) for p in e])
            tensors[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack([ckpt.read(p + "down_proj.weight") for p in e])
    write_safetensors(d / "model.safetensors", tensors)
    out = convert(d, tmp_path / "fused.gguf", high="f32", low="q4_0", base="f32", progress=False)
    ours = {t.name: np.asarray(t.data) for t in read(out).tensors}
    ref = {t.name: np.asarray(t.data) for t in read(converted("qwen3_moe", "f32")).tensors}
    assert ours.keys() == ref.keys()
    assert all(np.array_equal(ours[n], ref[n]) for n in ref)


def test_sharded_checkpoint_with_index(tiny_model, converted, tmp_path):
    d = broken_copy(tiny_model, tmp_path, "olmoe")
    with HFCheckpoint(d) as ckpt:
        names = ckpt.names()
        tensors = {n: ckpt.read(n) for n in names}
    (d / "model.safetensors").unlink()
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for shard, part in shards.items():
        write_safetensors(d / shard, {n: tensors[n] for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: s for s, part in shards.items() for n in part}}))
    out = convert(d, tmp_path / "sharded.gguf", high="f32", low="q4_0", base="f32", progress=False)
    ours = {t.name: np.asarray(t.data) for t in read(out).tensors}
    ref = {t.name: np.asarray(t.data) for t in read(converted("olmoe", "f32")).tensors}
    assert ours.keys() == ref.keys() and all(np.array_equal(ours[n], ref[n]) for n in ref)


def test_bf16_and_f16_tensors_are_read_exactly(tmp_path):
    import torch
    from safetensors.torch import save_file
    a = torch.randn(3, 5) * 100
    save_file({"a": a.to(torch.bfloat16), "b": a.to(torch.float16)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    with HFCheckpoint(tmp_path) as ckpt:
        assert np.array_equal(ckpt.read("a"), a.to(torch.bfloat16).float().numpy())
        assert np.array_equal(ckpt.read("b"), a.to(torch.float16).float().numpy())
        assert np.array_equal(ckpt.read_rows("a", 1, 3), a.to(torch.bfloat16).float().numpy()[1:3])


# ---------------------------------------------------------------------------------------------
# bad input: a clear ConversionError and no file


def assert_fails_cleanly(src: Path, out_dir: Path, match: str, **kwargs) -> None:
    out = out_dir / "out.gguf"
    before = dir_listing(out_dir)
    with pytest.raises(ConversionError, match=match):
        convert(src, out, progress=False, **kwargs)
    assert not out.exists()
    assert dir_listing(out_dir) == before  # no temporary file left either


def test_missing_config_is_an_error(tiny_model, tmp_path):
    d = broken_copy(tiny_model, tmp_path)
    (d / "config.json").unlink()
    assert_fails_cleanly(d, tmp_path, "no config.json")


def test_missing_shard_is_an_error(tiny_model, tmp_path):
    d = broken_copy(tiny_model, tmp_path)
    with HFCheckpoint(d) as ckpt:
        names = ckpt.names()
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{n: "model-00001-of-00002.safetensors" for n in names}, "extra.weight": "model-00002-of-00002.safetensors"}}))
    assert_fails_cleanly(d, tmp_path, "missing shard.*model-00002-of-00002")


def test_no_weights_is_an_error(tiny_model, tmp_path):
    d = broken_copy(tiny_model, tmp_path)
    (d / "model.safetensors").unlink()
    assert_fails_cleanly(d, tmp_path, "no model weights")


def test_shapes_that_disagree_with_the_config_are_an_error(tiny_model, tmp_path):
    d = broken_copy(tiny_model, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    assert_fails_cleanly(d, tmp_path, r"down_proj.weight has shape \[64, 32\], config.json implies \[64, 48\]")


def test_a_dense_layers_mlp_that_disagrees_with_the_config_is_an_error(tiny_model, tmp_path):
    # DeepSeek-V2's leading dense layer (first_k_dense_replace): its MLP went unchecked, into a file
    # llama.cpp refused ("check_tensor_dims")
    d = broken_copy(tiny_model, tmp_path, "deepseek_v2")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    assert_fails_cleanly(d, tmp_path, r"layers.0.mlp.(gate|up|down)_proj.weight has shape \[\d+, \d+\], config.json "
                                      r"implies \[(64, 48|48, 64)\]")


def test_an_attention_bias_of_another_size_is_named(tiny_model, tmp_path):
    # Mixtral takes optional q/k/v/o biases: one of the wrong size failed in the writer ("cannot reshape")
    from safetensors.numpy import load_file, save_file
    d = broken_copy(tiny_model, tmp_path, "mixtral")
    (d / "model.safetensors").unlink()
    tensors = load_file(tiny_model("mixtral")[1] / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(10, dtype=np.float32)
    save_file(tensors, d / "model.safetensors")
    assert_fails_cleanly(d, tmp_path, r"q_proj.bias has shape \[10\], config.json implies \[\d+\]")


def test_fewer_layers_than_the_config_is_an_error(tiny_model, tmp_path):
    d = broken_copy(tiny_model, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    assert_fails_cleanly(d, tmp_path, r"no tensors for layer\(s\) \[2\]")


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = edit(raw[8:8 + n])
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])


def test_unknown_dtype_is_an_error(tiny_model, tmp_path):
    d = broken_copy(tiny_model, tmp_path)
    _rewrite_header(d / "model.safetensors", lambda h: h.replace(b'"F32"', b'"F31"', 1))
    assert_fails_cleanly(d, tmp_path, "unknown dtype 'F31'")


def test_corrupt_safetensors_header_is_an_error(tiny_model, tmp_path):
    d = broken_copy(tiny_model, tmp_path)
    _rewrite_header(d / "model.safetensors", lambda h: h[: len(h) // 2])
    assert_fails_cleanly(d, tmp_path, "corrupt safetensors header")


def test_truncated_safetensors_is_an_error(tiny_model, tmp_path):
    d = broken_copy(tiny_model, tmp_path)
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    assert_fails_cleanly(d, tmp_path, "corrupt safetensors header")


def test_unsupported_architecture_lists_the_supported_ones(tiny_model, tmp_path):
    d = broken_copy(tiny_model, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert_fails_cleanly(d, tmp_path, "unsupported architecture 'LlamaForCausalLM'; supported: "
                         "DeepseekV2ForCausalLM, MixtralForCausalLM, OlmoeForCausalLM, PhiMoEForCausalLM")
    assert_fails_cleanly(d, tmp_path, re.escape("(other families: llama.cpp's convert_hf_to_gguf.py first, "
                                                "then convert its GGUF)"))


def test_bad_type_names_are_errors(tiny_model, tmp_path):
    _, hf_dir = tiny_model("olmoe")
    assert_fails_cleanly(hf_dir, tmp_path, "unknown ggml type 'q9_9'", low="q9_9")
    assert_fails_cleanly(hf_dir, tmp_path, "needs an importance matrix", low="iq2_xxs")


def test_a_repo_id_that_cannot_be_fetched_asks_to_download_first(tmp_path, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert_fails_cleanly(Path("pyedgemoe-test/no-such-model"), out_dir, "download the checkpoint first")


def test_a_path_that_does_not_exist_is_an_error(tmp_path):
    assert_fails_cleanly(tmp_path / "nowhere", tmp_path, "not found")
