"""What build_moe_ffn indexes by expert besides the stacked weights keeps working while the experts
are offloaded (patch 0002): per-expert scales (`blk.N.ffn_*_exps.scale`, which llama.cpp loads
for every architecture) multiply each selection by its own expert's scale, not by the scale of
the slot the expert happens to sit in."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pyedgemoe import Engine
from pyedgemoe.convert.from_gguf import copy_chunks, copy_kv, kv_value, open_gguf, tensor_ne, tensor_type_name
from pyedgemoe.convert.gguf_out import GGUFOutput
from pyedgemoe.gguf_format import is_expert_tensor

SETTINGS = dict(n_ctx=128, n_threads=2, flash_attn=False, kv_type="f32")
PROMPT = [1, 17, 42, 99, 5, 230, 64, 7]


def with_expert_scales(src: Path, out: Path) -> Path:
    """src with a per-expert scale beside every stacked expert tensor: 0.5 .. 1.5 over the experts,
    a different order per layer and projection, so a scale taken from the wrong expert shows."""
    reader = open_gguf(src, "model")
    output = GGUFOutput(out, arch=kv_value(reader, gguf.Keys.General.ARCHITECTURE), force=True)
    copy_kv(reader, output.writer, skip=lambda key: False)
    rng = np.random.default_rng(7)
    for t in reader.tensors:
        output.add_tensor(t.name, tensor_ne(t), tensor_type_name(t), (lambda s=t: copy_chunks(src, s)))
        if is_expert_tensor(t.name):
            n_expert = tensor_ne(t)[2]
            scales = rng.permutation(np.linspace(0.5, 1.5, n_expert)).astype(np.float32)
            name = t.name.removesuffix(".weight") + ".scale"
            output.add_tensor(name, [n_expert], "f32", (lambda a=scales: a))
    return output.finish(progress=False)


def greedy(path: Path, **options) -> list[int]:
    with Engine(path, **SETTINGS, **options) as eng:
        return eng.time_generation(PROMPT, 24)["tokens"]


@pytest.mark.parametrize("budget", ["50%", "minimum"])
def test_per_expert_scales_follow_the_expert_not_its_slot(tiny_model, tmp_path, budget):
    plain, _ = tiny_model("mixtral")
    scaled = with_expert_scales(plain, tmp_path / "scaled.gguf")
    resident = greedy(scaled)
    assert resident != greedy(plain), "the scales must change the output, or this test shows nothing"
    with Engine(scaled, **SETTINGS, expert_cache="50%") as eng:
        per_expert = eng.expert_residency["minimum_bytes"]
    cache = per_expert if budget == "minimum" else budget
    assert greedy(scaled, expert_cache=cache, fill_cache=False) == resident
