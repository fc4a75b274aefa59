"""Damaged converter input is a ConversionError naming the file and the field (issue #20;
docs/reliability.md), for what the fuzzer's seeds do not reach: every family's config.json (the
seeds have a Mixtral), the SentencePiece tokenizer files, and string arrays of a source GGUF.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import gguf
import pytest

from conftest import MOE_ARCHITECTURES
from test_convert_hf import phimoe_model  # noqa: F401 - a fixture: its tokenizer.model
from pyedgemoe.convert.from_gguf import convert_gguf
from pyedgemoe.convert.from_hf import family_for
from pyedgemoe.convert.hf_checkpoint import HFCheckpoint
from pyedgemoe.convert.tokenizer import spm_vocab
from pyedgemoe.errors import ConversionError

FAMILIES = [*MOE_ARCHITECTURES, "phimoe"]
WRONG_VALUES = ["x", [], {}, [1], -1, 0, 1.5, True, 2**40, math.inf, None]


def _config(tiny_model, arch: str) -> tuple[dict, Path]:
    """(config.json, HF dir) of the tiny model of `arch`; Phi-MoE's is Mixtral's renamed (the same
    hyperparameters, and the Phi-3 code's original context)."""
    _, hf_dir = tiny_model("mixtral" if arch == "phimoe" else arch)
    config = json.loads((hf_dir / "config.json").read_text())
    if arch == "phimoe":
        config.update(architectures=["PhiMoEForCausalLM"], original_max_position_embeddings=512)
    return config, hf_dir


def _use_config(config: dict, hf_dir: Path, tmp_path: Path) -> None:
    """Everything the converter takes from config.json alone: the family, its checks, its metadata,
    its expected shapes and tensor set."""
    d = tmp_path / "hf"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if not (d / "model.safetensors").exists():
        (d / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
    with HFCheckpoint(d) as ckpt:
        family = family_for(ckpt.config, len(ckpt.names()))
    family.check_config()
    family.write_hparams(gguf.GGUFWriter(None, family.llama_arch), 0)
    family.attention_shapes()
    for proj in family.expert_projs:
        family.expert_shape(proj)
    family.extra_tensors()
    family.loader_tensors()


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_config_key_deleted_or_of_the_wrong_type_is_a_conversion_error(tiny_model, tmp_path, arch):
    config, hf_dir = _config(tiny_model, arch)
    _use_config(config, hf_dir, tmp_path)
    unexpected = []
    for key in config:
        variants = [{k: v for k, v in config.items() if k != key}] + [{**config, key: v} for v in WRONG_VALUES]
        for variant in variants:
            try:
                _use_config(variant, hf_dir, tmp_path)
            except ConversionError:
                pass
            except Exception as e:  # noqa: BLE001 - the failure this test looks for
                unexpected.append(f"{key}={variant.get(key, '<deleted>')!r}: {type(e).__name__}: {e}")
    assert not unexpected, "\n".join(unexpected)


@pytest.mark.parametrize("arch, key", [("mixtral", "vocab_size"), ("deepseek_v2", "v_head_dim"),
                                       ("deepseek_v2", "vocab_size"), ("phimoe", "rms_norm_eps"),
                                       # the last three converted, into files llama.cpp does not load
                                       ("qwen3_moe", "max_position_embeddings"), ("qwen3_moe", "num_experts_per_tok"),
                                       ("qwen2_moe", "shared_expert_intermediate_size")])
def test_a_required_hyperparameter_missing_is_named(tiny_model, tmp_path, arch, key):
    config, hf_dir = _config(tiny_model, arch)
    del config[key]
    with pytest.raises(ConversionError, match=f"config.json has no {key}( / [a-z_]+)*, which llama.cpp's"):
        _use_config(config, hf_dir, tmp_path)


def test_a_switch_written_as_text_is_refused(tiny_model, tmp_path):
    # "false" is true to Python: DeepSeek's output matrix was dropped as tied, and the file gave garbage
    config, hf_dir = _config(tiny_model, "deepseek_v2")
    config["tie_word_embeddings"] = "false"
    with pytest.raises(ConversionError, match="tie_word_embeddings is 'false', expected true or false"):
        _use_config(config, hf_dir, tmp_path)


def test_more_layers_than_tensors_is_refused_before_the_layers_are_named(tiny_model, tmp_path):
    # gguf-py's name map of every layer was built first: a million layers took gigabytes
    config, hf_dir = _config(tiny_model, "qwen3_moe")
    config["num_hidden_layers"] = 10**6
    with pytest.raises(ConversionError, match="config.json says 1000000 layers, but the checkpoint has only"):
        _use_config(config, hf_dir, tmp_path)


def test_phimoe_without_rope_theta_is_named(tiny_model, tmp_path):
    config, hf_dir = _config(tiny_model, "phimoe")
    config["rope_parameters"] = {"rope_type": "default"}
    with pytest.raises(ConversionError, match="config.json has no rope_theta"):
        _use_config(config, hf_dir, tmp_path)


def test_yarn_without_its_original_context_is_named(tiny_model, tmp_path):
    config, hf_dir = _config(tiny_model, "qwen3_moe")
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    with pytest.raises(ConversionError, match="YaRN rope scaling without original_max_position_embeddings"):
        _use_config(config, hf_dir, tmp_path)


# -- SentencePiece tokenizer files (the seeds' tokenizer is BPE) ----------------------------------

def _spm_dir(tmp_path: Path, phimoe_model) -> Path:
    """A directory with a real tokenizer.model (the Phi-MoE test model's)."""
    d = tmp_path / "spm"
    d.mkdir()
    shutil.copyfile(phimoe_model[1] / "tokenizer.model", d / "tokenizer.model")
    return d


@pytest.mark.parametrize("name, content, match", [
    ("added_tokens.json", {"<x>": "5"}, r"added_tokens.json: the token '<x>' is \"5\", expected a token id"),
    ("added_tokens.json", [1, 2], r"added_tokens.json is not a JSON object: \[1, 2\]"),
    ("tokenizer_config.json", {"added_tokens_decoder": {"5": {"special": True}}},
     r"tokenizer_config.json: added_tokens_decoder\['5'\] is .*, expected an added token"),
    ("tokenizer_config.json", {"added_tokens_decoder": {"-1": {"content": "<x>"}}},
     r"added_tokens_decoder has the key '-1', expected a token id"),
    ("tokenizer_config.json", {"add_prefix_space": "yes"}, "add_prefix_space is \"yes\", expected true or false"),
    ("tokenizer_config.json", {"chat_template": [{"name": 1}]}, "chat_template is .*, expected a string or a list"),
])
def test_damaged_sentencepiece_tokenizer_files_are_named(tmp_path, phimoe_model, name, content, match):
    d = _spm_dir(tmp_path, phimoe_model)
    (d / name).write_text(json.dumps(content))
    with pytest.raises(ConversionError, match=match):
        spm_vocab(d, None)


def test_a_lone_surrogate_in_an_added_token_is_refused(tmp_path, phimoe_model):
    d = _spm_dir(tmp_path, phimoe_model)
    (d / "added_tokens.json").write_text('{"\\udcff": 5}')  # valid JSON, not writable as UTF-8
    with pytest.raises(ConversionError, match="added_tokens.json: the token"):
        spm_vocab(d, None)


# -- a source GGUF ----------------------------------------------------------------------------------

def test_a_token_that_is_not_utf8_is_named_with_its_index(tiny_model, tmp_path):
    src, _ = tiny_model("mixtral")
    data = bytearray(src.read_bytes())
    # the token list comes before the chat template, which also holds these tokens
    at = data.index(b"<|im_end|>")
    data[at] = 0xFF
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ConversionError, match=r"element 2 of key 'tokenizer.ggml.tokens' is not valid UTF-8"):
        convert_gguf(bad, tmp_path / "out.gguf", high="f32", low="f16", dry_run=True, progress=False)


@pytest.mark.parametrize("arch, setting, message", [
    # each converted (as llama.cpp's converter does) into a file whose logits were 1 to 3 off transformers'
    ("qwen3_moe", {"norm_topk_prob": False}, "norm_topk_prob=false .* always renormalizes"),
    ("qwen2_moe", {"norm_topk_prob": True}, "norm_topk_prob=true .* never renormalizes"),
    ("olmoe", {"norm_topk_prob": True}, "norm_topk_prob=true .* never renormalizes"),
    ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act=gelu .* with SiLU"),
    ("qwen3_moe", {"rope_parameters": {"rope_theta": 1e6, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 128}},
     "rope_type=llama3 .* no llama3 frequency scaling"),
])
def test_a_setting_llama_cpp_would_compute_otherwise_is_refused(tiny_model, tmp_path, arch, setting, message):
    config, hf_dir = _config(tiny_model, arch)
    with pytest.raises(ConversionError, match=f"config.json {message}"):
        _use_config({**config, **setting}, hf_dir, tmp_path)
