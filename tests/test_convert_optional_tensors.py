"""The converter never writes a file the runtime cannot load (issue #20, item 6).

A family's config.json switches optional tensors on or off: attention (q/k/v/o) and lm_head
biases, tied embeddings, shared experts, dense layers, q LoRA. llama.cpp's loader (the vendored
src/models/<arch>.cpp) requires some tensors, takes others when present, and refuses a file with
any tensor it does not create. For every switch in the state tests/test_convert_hf.py's tiny models
do not cover, a tiny checkpoint is built with transformers from the config and converted, and:

- the file loads in pyedgemoe and gives transformers' logits and greedy tokens; or
- llama.cpp requires a tensor the checkpoint lacks, and the converter writes its exact stand-in
  (a zero bias, a copy of the embedding matrix): the logits equal those of the same checkpoint
  with that tensor made explicit; or
- the conversion is refused with one ConversionError naming the setting, and no file is left.

The matrix (default state: test_convert_hf.py's tiny model of the family):

    family       switch                              result
    mixtral      tie_word_embeddings                 loads (llama.cpp uses token_embd as output)
    qwen2_moe    qkv_bias=false                      loads
    qwen2_moe    tie_word_embeddings                 output.weight written as a copy of token_embd
    qwen2_moe    shared_expert_intermediate_size=0   refused (llama.cpp requires a shared expert)
    qwen2_moe    mlp_only_layers / sparse step       refused (llama.cpp: MoE in every layer)
    qwen3_moe    tie_word_embeddings                 loads
    qwen3_moe    attention_bias                      refused (no attn_output.bias in llama.cpp)
    qwen3_moe    decoder_sparse_step=2               refused
    olmoe        tie_word_embeddings                 output.weight written as a copy of token_embd
    olmoe        attention_bias                      refused (no attn_output.bias in llama.cpp)
    olmoe        clip_qkv                            refused (llama.cpp's olmoe does not clamp)
    phimoe       attention_bias=false                attn_output.bias written as zeros
    phimoe       lm_head_bias=false                  output.bias written as zeros
    phimoe       tie_word_embeddings                 output.weight written as a copy of token_embd
    deepseek_v2  tie_word_embeddings                 loads
    deepseek_v2  q_lora_rank=null (V2-Lite)          loads (q_lora_rank written as 0)
    deepseek_v2  first_k_dense_replace=0             loads
    deepseek_v2  attention_bias / mlp_bias           refused (llama.cpp has no such biases)
    deepseek_v2  n_shared_experts=0                  refused (llama.cpp requires shared experts)
    deepseek_v2  moe_layer_freq=2, lite q LoRA       refused (config edits; transformers ignores them)

qk-norms are not optional in any supported family (Qwen3-MoE, OLMoE always have them); a checkpoint
lacking one is refused like any missing required tensor.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import tiny_moe
from pyedgemoe import ConversionError, Engine
from pyedgemoe.convert import convert
from test_cli import assert_one_line_error, cli
from test_convert_hf import IDS, SETTINGS, assert_fails_cleanly, build_phimoe, kv, read

F32 = dict(high="f32", low="q4_0", base="f32", progress=False)
N_DECODE = 6


def build(arch: str, overrides: dict, d: Path) -> Path:
    if arch == "phimoe":
        build_phimoe(d, overrides)
    else:
        tiny_moe.build_hf_checkpoint(arch, d, overrides=overrides)
    return d


def edit_checkpoint(d: Path, edit_tensors=None, **config) -> None:
    """Rewrite d's weights through edit_tensors(dict) -> dict and update its config.json."""
    if edit_tensors is not None:
        path = d / "model.safetensors"
        save_file(edit_tensors(load_file(str(path))), str(path), metadata={"format": "pt"})
    if config:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(config)
        (d / "config.json").write_text(json.dumps(cfg, indent=2))


def greedy_tokens(path: Path, prompt: list[int]) -> list[int]:
    with Engine(path, **SETTINGS) as eng:
        return eng.time_generation(prompt, N_DECODE)["tokens"]


def tensor_data(path: Path) -> dict[str, np.ndarray]:
    return {t.name: np.asarray(t.data) for t in read(path).tensors}


# ---------------------------------------------------------------------------------------------
# switches llama.cpp's loader takes as they are, or with the converter's exact stand-in


LOADS = [
    # (family, config switch, the stand-in tensor the converter writes, if any)
    ("mixtral", {"tie_word_embeddings": True}, None),
    ("qwen2_moe", {"qkv_bias": False}, None),
    ("qwen2_moe", {"tie_word_embeddings": True}, "output.weight"),
    ("qwen3_moe", {"tie_word_embeddings": True}, None),
    ("olmoe", {"tie_word_embeddings": True}, "output.weight"),
    ("deepseek_v2", {"tie_word_embeddings": True}, None),
    ("deepseek_v2", {"q_lora_rank": None}, None),
    ("deepseek_v2", {"first_k_dense_replace": 0}, None),
]


@pytest.mark.parametrize("arch,overrides,stand_in", LOADS, ids=[f"{a}-{next(iter(o))}" for a, o, _ in LOADS])
def test_converts_loads_and_matches_transformers(arch, overrides, stand_in, tmp_path):
    hf_dir = build(arch, overrides, tmp_path / "hf")
    out = convert(hf_dir, tmp_path / "out.gguf", **F32)
    prompt = IDS[:8]
    ours = greedy_tokens(out, prompt)
    assert len(ours) == N_DECODE
    sequence = prompt + ours[:-1]
    reference = tiny_moe.transformers_logits(hf_dir, sequence)
    with Engine(out, **SETTINGS) as eng:
        logits = eng.logits(sequence)
    assert np.max(np.abs(logits - reference)) <= 1e-3
    assert ours == [int(np.argmax(r)) for r in reference[len(prompt) - 1:]]
    names = {t.name for t in read(out).tensors}
    if stand_in == "output.weight":
        data = tensor_data(out)
        assert np.array_equal(data["output.weight"], data["token_embd.weight"])
    elif overrides.get("tie_word_embeddings"):
        assert "output.weight" not in names  # llama.cpp's loader uses token_embd.weight


def test_deepseek_v2_lite_attention_is_written_with_q_lora_rank_0(tmp_path):
    hf_dir = build("deepseek_v2", {"q_lora_rank": None}, tmp_path / "hf")
    r = read(convert(hf_dir, tmp_path / "out.gguf", **F32))
    assert kv(r, "deepseek2.attention.q_lora_rank") == 0
    names = {t.name for t in r.tensors}
    assert "blk.0.attn_q.weight" in names and "blk.0.attn_q_a.weight" not in names


# Phi-MoE: transformers routes it differently from llama.cpp (tiny_moe.py), so the reference is the
# same checkpoint with the absent tensors made explicit, converted without stand-ins (the path that
# test_convert_hf.py shows writes exactly llama.cpp's converter's file).

def _explicit_attention_biases(t: dict) -> dict:
    for name in [n for n in t if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))]:
        t[name.replace(".weight", ".bias")] = np.zeros(t[name].shape[0], np.float32)
    return t


def _explicit_lm_head_bias(t: dict) -> dict:
    t["lm_head.bias"] = np.zeros(t["lm_head.weight"].shape[0], np.float32)
    return t


def _explicit_lm_head(t: dict) -> dict:
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    return t


PHIMOE_STAND_INS = [
    # (config switch, what the converter writes, the same checkpoint with it explicit)
    ({"attention_bias": False}, ["blk.0.attn_output.bias", "blk.1.attn_output.bias"],
     (_explicit_attention_biases, {"attention_bias": True})),
    ({"lm_head_bias": False}, ["output.bias"], (_explicit_lm_head_bias, {"lm_head_bias": True})),
    ({"tie_word_embeddings": True}, ["output.weight"], (_explicit_lm_head, {"tie_word_embeddings": False})),
]


@pytest.mark.parametrize("overrides,written,explicit", PHIMOE_STAND_INS,
                         ids=[next(iter(o)) for o, _, _ in PHIMOE_STAND_INS])
def test_phimoe_gets_exact_stand_ins_for_what_llama_cpp_requires(overrides, written, explicit, tmp_path):
    hf_dir = build("phimoe", overrides, tmp_path / "hf")
    out = convert(hf_dir, tmp_path / "out.gguf", **F32)
    data = tensor_data(out)
    for name in written:
        if name == "output.weight":
            assert np.array_equal(data[name], data["token_embd.weight"])
        else:
            assert not data[name].any(), name
    ref_dir = tmp_path / "hf-explicit"
    shutil.copytree(hf_dir, ref_dir)
    edit_tensors, config = explicit
    edit_checkpoint(ref_dir, edit_tensors, **config)
    reference = convert(ref_dir, tmp_path / "reference.gguf", **F32)
    with Engine(out, **SETTINGS) as eng:
        ours = eng.logits(IDS)
    with Engine(reference, **SETTINGS) as eng:
        theirs = eng.logits(IDS)
    assert np.array_equal(ours, theirs)
    assert greedy_tokens(out, IDS[:8]) == greedy_tokens(reference, IDS[:8])


# ---------------------------------------------------------------------------------------------
# switches llama.cpp cannot reproduce: one ConversionError, no file


REFUSED = [
    ("qwen2_moe", {"shared_expert_intermediate_size": 0},
     "shared_expert_intermediate_size=0 is not supported: llama.cpp's qwen2moe model requires a shared expert"),
    ("qwen2_moe", {"mlp_only_layers": [1]},
     r"mlp_only_layers=\[1\] is not supported: it makes layer\(s\) \[1\] dense, and llama.cpp's qwen2moe"),
    ("qwen3_moe", {"decoder_sparse_step": 2},
     r"decoder_sparse_step=2 is not supported: it makes layer\(s\) \[0\] dense, and llama.cpp's qwen3moe"),
    ("qwen3_moe", {"attention_bias": True},
     "attention_bias=true is not supported: llama.cpp's qwen3moe model has no attention output bias"),
    ("olmoe", {"attention_bias": True},
     "attention_bias=true is not supported: llama.cpp's olmoe model has no attention output bias"),
    ("olmoe", {"clip_qkv": 0.5}, "clip_qkv=0.5 is not supported: llama.cpp's olmoe model does not clamp q/k/v"),
    ("deepseek_v2", {"attention_bias": True},
     "attention_bias=true is not supported: llama.cpp's deepseek2 model has no attention biases"),
    ("deepseek_v2", {"mlp_bias": True}, "mlp_bias=true is not supported: llama.cpp's deepseek2 model has no feed"),
    ("deepseek_v2", {"n_shared_experts": 0},
     "n_shared_experts=0 is not supported: llama.cpp's deepseek2 model requires shared experts"),
]


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # transformers building a size-0 expert
@pytest.mark.parametrize("arch,overrides,match", REFUSED, ids=[f"{a}-{next(iter(o))}" for a, o, _ in REFUSED])
def test_refused_with_one_error_and_no_file(arch, overrides, match, tmp_path):
    hf_dir = build(arch, overrides, tmp_path / "hf")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert_fails_cleanly(hf_dir, out_dir, "^config.json " + match)
    with pytest.raises(ConversionError, match=match):
        convert(hf_dir, out_dir / "dry.gguf", dry_run=True)


@pytest.mark.parametrize("config,match", [
    ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported: llama.cpp's deepseek2 model has a MoE block in every"),
    ({"num_hidden_layers": 27}, "q_lora_rank=32 is not supported: llama.cpp takes a 27-layer deepseek2 model for "
                                "DeepSeek-V2-Lite"),
], ids=["moe_layer_freq", "lite-with-q-lora"])
def test_deepseek_v2_settings_llama_cpp_reads_otherwise_are_refused(tiny_model, tmp_path, config, match):
    d = tmp_path / "hf"
    shutil.copytree(tiny_model("deepseek_v2")[1], d)
    edit_checkpoint(d, **config)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert_fails_cleanly(d, out_dir, match)


# ---------------------------------------------------------------------------------------------
# the tensor set itself, whatever config.json says


def assert_edited_checkpoint_refused(hf_dir: Path, tmp_path: Path, edit, message: str) -> None:
    """A copy of hf_dir with its tensors edited (edit: {name: array} -> {name: array}) converts to
    one error matching message, and no file."""
    d = tmp_path / "hf"
    shutil.copytree(hf_dir, d)
    edit_checkpoint(d, edit)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert_fails_cleanly(d, out_dir, message)


def test_a_tensor_llama_cpp_requires_that_the_checkpoint_lacks_is_refused(tiny_model, tmp_path):
    assert_edited_checkpoint_refused(
        tiny_model("qwen2_moe")[1], tmp_path,
        lambda t: {n: a for n, a in t.items() if n != "model.layers.1.mlp.shared_expert_gate.weight"},
        "the checkpoint has no tensor for blk.1.ffn_gate_inp_shexp.weight, which llama.cpp's qwen2moe model requires")


def test_a_tensor_llama_cpp_has_no_place_for_is_refused(tiny_model, tmp_path):
    assert_edited_checkpoint_refused(
        tiny_model("qwen3_moe")[1], tmp_path,
        lambda t: {**t, "model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)},
        r"tensor model.layers.0.self_attn.o_proj.bias \(GGUF blk.0.attn_output.bias\) "
        "has no place in llama.cpp's qwen3moe model")


def test_a_missing_lm_head_is_refused_unless_the_config_ties_it(tiny_model, tmp_path):
    # llama.cpp's llama loader would quietly use token_embd; transformers would use random weights
    assert_edited_checkpoint_refused(
        tiny_model("mixtral")[1], tmp_path, lambda t: {n: a for n, a in t.items() if n != "lm_head.weight"},
        r"no lm_head.weight, and config.json does not tie")


def test_phimoe_biases_are_zero_only_where_the_config_says_there_are_none(tmp_path):
    d = build("phimoe", {}, tmp_path / "hf")  # attention_bias true
    edit_checkpoint(d, lambda t: {n: a for n, a in t.items() if not n.endswith("o_proj.bias")})
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert_fails_cleanly(d, out_dir, "the checkpoint has no tensor for blk.0.attn_output.bias, which llama.cpp's "
                                     "phimoe model requires")


# ---------------------------------------------------------------------------------------------
# the CLI


def test_cli_converts_phimoe_without_lm_head_bias_and_runs_it(tmp_path):
    # the reported case: this file used to fail to load with "tensor 'output.bias' not found"
    hf_dir = build("phimoe", {"lm_head_bias": False}, tmp_path / "hf")
    out = tmp_path / "phi.gguf"
    r = cli("convert", hf_dir, "-o", out, "--high", "q8_0", "--low", "q4_0")
    assert r.returncode == 0, r.stderr
    r = cli("run", out, "-p", "hello world", "-n", "4", "--temp", "0", "-t", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_cli_refusal_is_one_error_line(tmp_path):
    hf_dir = build("olmoe", {"attention_bias": True}, tmp_path / "hf")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    r = cli("convert", hf_dir, "-o", out_dir / "o.gguf")
    assert_one_line_error(r, "error: config.json attention_bias=true is not supported: llama.cpp's olmoe model")
    assert r.returncode == 1
    assert list(out_dir.iterdir()) == []
