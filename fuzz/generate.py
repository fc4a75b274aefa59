"""Choosing mutations at random: a recipe for one input, aimed at one parser.

A recipe is `{"seed", "parser", "run_options", "mutations": [...]}`; mutations.py applies it. The
choices are structured, not blind bit flips: a mutation knows the field it damages (a metadata value
of the wrong type, a string that is not UTF-8, an array that declares more items than it holds, a
tensor whose dims or offset point past the data, a LOW copy of the wrong type, a sidecar whose
precision map names a layer that does not exist, a safetensors entry whose offsets disagree with its
shape...) and picks values from the edges: 0, 1, -1, powers of two and their neighbours, 2^31, 2^32,
2^63, 2^64 - 1, NaN and the infinities, the empty string, lone continuation bytes.

Everything draws from the one random.Random it is given: a seed number gives the same recipes
(tests/test_fuzz_replay.py relies on it).
"""
from __future__ import annotations

import json
import random

from gguf import GGMLQuantizationType
from gguf import GGUFValueType as VT

from fuzz import gguf_file
from fuzz.gguf_file import Array
from fuzz.mutations import apply_one, dump_json, enc, mutate_json, split_safetensors
from fuzz.seeds import Seed

# parser -> (seeds it is fuzzed through, weight)
PARSERS: dict[str, tuple[tuple[str, ...], float]] = {
    "gguf header": (("std", "mp"), 1.0),
    "gguf metadata": (("std", "mp", "mp-embedded"), 2.0),
    "edgemoe metadata": (("mp", "mp-embedded"), 2.0),
    "gguf tensor directory": (("std", "mp"), 2.0),
    "gguf tensor data": (("std", "mp"), 0.7),
    "calibration sidecar": (("mp", "std"), 2.0),
    "hf config.json": (("hf",), 1.5),
    "safetensors": (("hf",), 1.5),
    "safetensors index": (("hf",), 0.5),
    "hf tokenizer files": (("hf",), 0.7),
}

INTS = [0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 33, 48, 63, 64, 65, 127, 128, 255, 256, 384, 4095, 4096, 4097,
        65535, 65536, 2**24, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**48, 2**62, 2**63 - 1, 2**63, 2**64 - 1,
        -1, -2, -2**31, -2**63]
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 0.6, 0.9, 1.0000001, -1e-9, 2.0, 1e-45, 1e30, 3.4e38, 1e308,
          "inf", "-inf", "nan"]
STRINGS = [b"", b"\xff", b"\xff\xfe\xfd\xfc", b"\xc3\x28", b"\xed\xa0\x80", b"\xe2\x82", b"\x80abc",
           b"valid\xffthen", b"a\x00b", "ünïcødé 🦙".encode(), b"A" * 300, b"%s%s%n", b"{", b"{}", b"[]",
           b"null", b'{"version": 1, "t1": 0.5, "t2": 0.4}', b"f32", b"f16", b"q4_0", b"q4_K", b"Q8_0",
           b"iq1_s", b"bogus", b"llama", b"qwen3moe", b"deepseek2", b"llama\x00x"]
JSON_VALUES = [None, True, False, 0, 1, -1, 2, 3, 0.5, 1.5, 1e308, -1e308, {"float": "nan"}, {"float": "inf"},
               {"float": "-inf"}, 2**64, -2**63, "", "x", "0.5", "hobbit", "lru", "unknown", "\udcff",
               [], {}, [0, 0, 0, 0], [1, 1, 1, 1], [0] * 100, {"0": [0]}, {"0": []}, {"99": [0]}, {"-1": [0]},
               [[]], [-1], [99], [1.5], ["0"], [None]]
GGML_TYPES = [int(t) for t in GGMLQuantizationType]
BAD_GGML_TYPES = [4, 5, 31, 32, 33, 36, 37, 38, 42, 43, 100, 2**31, 2**32 - 1]
ARCH_KEYS = ["block_count", "expert_count", "expert_used_count", "expert_shared_count", "context_length",
             "embedding_length", "feed_forward_length", "expert_feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "rope.dimension_count", "vocab_size", "attention.layer_norm_rms_epsilon",
             "rope.freq_base"]
GENERAL_KEYS = ["general.architecture", "general.alignment", "general.name", "general.file_type",
                "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.chat_template"]
EDGEMOE_KEYS = ["edgemoe.format_version", "edgemoe.high_type", "edgemoe.low_type", "edgemoe.provenance",
                "edgemoe.calibration.t1", "edgemoe.calibration.t2", "edgemoe.calibration.policy_weights",
                "edgemoe.calibration.json", "edgemoe.unknown_key"]
JSON_STRING_KEYS = (b"edgemoe.provenance", b"edgemoe.calibration.json")
# the paths a JSON file's readers care most about (a path's prefix counts too)
IMPORTANT_PATHS = {
    "calibration": [["version"], ["t1"], ["t2"], ["policy_weights"], ["best_policy"], ["expert_usage"],
                    ["precision_map"], ["precision_map", "low"], ["precision_map", "n_low"],
                    ["precision_map", "n_experts"], ["path_statistics"]],
    "config": [["num_local_experts"], ["num_experts_per_tok"], ["hidden_size"], ["intermediate_size"],
               ["num_hidden_layers"], ["num_attention_heads"], ["num_key_value_heads"], ["vocab_size"],
               ["model_type"], ["architectures"], ["architectures", 0], ["rope_parameters"], ["rms_norm_eps"],
               ["head_dim"], ["tie_word_embeddings"], ["max_position_embeddings"], ["text_config"],
               ["bos_token_id"], ["eos_token_id"], ["dtype"]],
    "index": [["weight_map"]],
    "tokenizer": [["model", "vocab"], ["model", "merges"], ["added_tokens"], ["model", "type"], ["pre_tokenizer"],
                  ["chat_template"], ["bos_token"], ["eos_token"], ["added_tokens_decoder"], ["model_max_length"]],
}


def recipe(rng: random.Random, seeds: dict[str, Seed]) -> dict:
    """One input: a parser, a seed that exercises it, 1-3 mutations of that parser's file."""
    while True:
        r = _recipe(rng, seeds)
        if r["mutations"]:
            return r


def _recipe(rng: random.Random, seeds: dict[str, Seed]) -> dict:
    names = list(PARSERS)
    parser = rng.choices(names, weights=[PARSERS[p][1] for p in names])[0]
    seed = seeds[rng.choice(PARSERS[parser][0])]
    files = dict(seed.files)
    mutations = []
    for _ in range(rng.choices([1, 2, 3], weights=[0.6, 0.25, 0.15])[0]):
        try:
            m = mutation(rng, parser, seed, files)
            files[m["file"]] = apply_one(m["file"], files[m["file"]], m)
        except Exception:  # an earlier mutation left nothing this one can parse: skip it
            continue
        mutations.append(m)
    return {"seed": seed.name, "parser": parser, "run_options": rng.choice(seed.run_variants),
            "mutations": mutations}


def mutation(rng: random.Random, parser: str, seed: Seed, files: dict[str, bytes]) -> dict:
    if parser.startswith("gguf") or parser == "edgemoe metadata":
        return {"file": "model.gguf", **_gguf(rng, parser, files["model.gguf"])}
    if parser == "calibration sidecar":
        name = "calibration.json" if seed.name == "std" else "model.gguf.calibration.json"
        return {"file": name, **_json_file(rng, files[name], "calibration")}
    if parser == "hf config.json":
        return {"file": "hf/config.json", **_json_file(rng, files["hf/config.json"], "config")}
    if parser == "safetensors index":
        name = "hf/model.safetensors.index.json"
        return {"file": name, **_json_file(rng, files[name], "index")}
    if parser == "hf tokenizer files":
        name = rng.choice([n for n in files if "token" in n or n.endswith(".jinja")])
        if name.endswith(".json"):
            return {"file": name, **_json_file(rng, files[name], "tokenizer")}
        return {"file": name, **_bytes(rng, files[name], 0, len(files[name]))}
    return {"file": "hf/model.safetensors", **_safetensors(rng, files["hf/model.safetensors"])}


# -- values --------------------------------------------------------------------------------------------

def int_near(rng: random.Random, v: int) -> int:
    return rng.choice([rng.choice(INTS), v + 1, v - 1, v * 2, v // 2, v * 1000, -v, v + 2**32])


def string_variant(rng: random.Random, s: bytes) -> bytes:
    if s and rng.random() < 0.4:
        i = rng.randrange(len(s))
        return rng.choice([s[:i] + b"\xff" + s[i + 1:], s[:i], s + b"\x80", s[:i] + b"\x00" + s[i:], s * 50])
    return rng.choice(STRINGS)


def gguf_value(rng: random.Random, vtype: int, old=None):
    """A recipe value of GGUF type vtype (the recipe form: bytes as enc(), arrays as dicts)."""
    if vtype == VT.STRING:
        return enc(string_variant(rng, old if isinstance(old, bytes) else b""))
    if vtype == VT.ARRAY:
        return _array_value(rng, old)
    if vtype in (VT.FLOAT32, VT.FLOAT64):
        return rng.choice(FLOATS)
    if vtype == VT.BOOL:
        return rng.choice([0, 1, 2, 255])
    return int_near(rng, old if isinstance(old, int) else 1)


def _array_value(rng: random.Random, old) -> dict:
    items = old.items if isinstance(old, Array) else []
    item_type = old.item_type if isinstance(old, Array) else VT.UINT32
    choice = rng.randrange(6)
    if choice == 0:  # empty
        return {"item_type": item_type, "items": []}
    if choice == 1:  # another item type
        t = rng.choice([VT.UINT8, VT.INT32, VT.FLOAT32, VT.STRING, VT.BOOL, VT.UINT64])
        return {"item_type": t, "items": [gguf_value(rng, t) for _ in range(rng.choice([1, 4, len(items) or 1]))]}
    if choice == 2:  # nested arrays
        return {"item_type": VT.ARRAY, "items": [{"item_type": VT.UINT8, "items": [1, 2]}]}
    if choice == 3 and items:  # one item damaged
        items = [enc(v) if isinstance(v, bytes) else v for v in items]
        i = rng.randrange(len(items))
        items[i] = gguf_value(rng, item_type, old.items[i])
        return {"item_type": item_type, "items": items}
    if choice == 4:  # four numbers (policy_weights) at the edges
        return {"item_type": VT.FLOAT32, "items": [rng.choice(FLOATS) for _ in range(rng.choice([3, 4, 5]))]}
    return {"item_type": item_type, "items": [enc(v) if isinstance(v, bytes) else v for v in items] * 2}


def json_value(rng: random.Random, old=None):
    if old is not None and rng.random() < 0.3:
        return rng.choice([str(old) if not isinstance(old, str) else 0, [old], {"v": old},
                           -old if isinstance(old, (int, float)) and not isinstance(old, bool) else None])
    return rng.choice(JSON_VALUES)


# -- GGUF ---------------------------------------------------------------------------------------------

def _gguf(rng: random.Random, parser: str, data: bytes) -> dict:
    try:
        gf = gguf_file.parse(data)
    except Exception:
        return _bytes(rng, data, 0, len(data))
    header_end = len(gf.header_bytes())
    if parser == "gguf header":
        return _gguf_header(rng, gf, data, header_end)
    if parser == "gguf tensor directory":
        return _gguf_tensor(rng, gf)
    if parser == "gguf tensor data":
        return _gguf_data(rng, gf, data, header_end)
    return _gguf_kv(rng, gf, parser)


def _gguf_header(rng: random.Random, gf, data: bytes, header_end: int) -> dict:
    choice = rng.randrange(6)
    if choice == 0:
        return {"op": "magic", "value": enc(rng.choice([b"GGUG", b"\0\0\0\0", b"FUGG", b"GGU\xff"]))}
    if choice == 1:
        return {"op": "version", "value": rng.choice([0, 1, 2, 4, 5, 2**31, 2**32 - 1])}
    if choice == 2:
        which = rng.choice(["n_kv", "n_tensors"])
        true = len(gf.kvs) if which == "n_kv" else len(gf.tensors)
        return {"op": "count", "field": which, "value": rng.choice([0, true - 1, true + 1, true * 2, 2**31, 2**63,
                                                                    2**64 - 1])}
    if choice == 3:
        at = rng.choice([0, 4, 8, 16, 23, 24, header_end - 1, header_end, rng.randrange(header_end)])
        return {"op": "truncate", "at": at}
    return _bytes(rng, data, 0, header_end)


def _gguf_kv(rng: random.Random, gf, parser: str) -> dict:
    arch = gf.kv(b"general.architecture")
    arch = arch.value.decode("utf-8", "replace") if arch and isinstance(arch.value, bytes) else "llama"
    existing = [kv.key for kv in gf.kvs]
    if parser == "edgemoe metadata":
        candidates = [k for k in existing if k.startswith(b"edgemoe.")] + [k.encode() for k in EDGEMOE_KEYS]
    else:
        candidates = ([k for k in existing if not k.startswith(b"edgemoe.")]
                      + [f"{arch}.{k}".encode() for k in ARCH_KEYS] + [k.encode() for k in GENERAL_KEYS])
    key = rng.choice(candidates)
    kv = gf.kv(key)
    if kv is None:  # a key the file lacks: add it, of a plausible type or not
        t = rng.choice([VT.UINT32, VT.INT32, VT.FLOAT32, VT.STRING, VT.ARRAY, VT.UINT64, VT.BOOL])
        return {"op": "kv_set", "key": enc(key), "type": int(t), "value": gguf_value(rng, t)}
    r = rng.random()
    if kv.key in JSON_STRING_KEYS and r < 0.4:  # a JSON document in a string: damage its structure
        try:
            doc = json.loads(kv.value)
            m = _json_doc_op(rng, doc, "calibration")
            new, depth = mutate_json(doc, m)
            return {"op": "kv_set", "key": enc(key), "type": int(VT.STRING),
                    "value": enc(dump_json(new, depth).encode("utf-8", "surrogatepass"))}
        except Exception:  # noqa: BLE001 - not JSON, or nothing this op can damage: a plain mutation below
            pass
    if r < 0.35:
        return {"op": "kv_set", "key": enc(key), "type": kv.type, "value": gguf_value(rng, kv.type, kv.value)}
    if r < 0.5:
        t = rng.choice([t for t in VT if t != kv.type])
        return {"op": "kv_set", "key": enc(key), "type": int(t), "value": gguf_value(rng, t)}
    if r < 0.6:
        return {"op": "kv_delete", "key": enc(key)}
    if r < 0.67:
        to = rng.choice([b"", b"\xff" + key, key + b"\xc3", key * 20, rng.choice(existing), key.upper()])
        return {"op": "kv_rename", "key": enc(key), "to": enc(to)}
    if r < 0.72:
        return {"op": "kv_duplicate", "key": enc(key)}
    if kv.type == VT.ARRAY and r < 0.84:
        n = len(kv.value.items)
        if r < 0.78:
            return {"op": "array_count", "key": enc(key), "count": rng.choice([n + 1, n * 2, 2**32, 2**62, 2**64 - 1])}
        return {"op": "array_keep", "key": enc(key), "keep": rng.choice([0, 1, n // 2, max(n - 1, 0)])}
    if kv.type == VT.STRING and r < 0.84:
        n = len(kv.value)
        return {"op": "string_length", "key": enc(key), "length": rng.choice([n + 1, n + 8, 2**32, 2**63, 2**64 - 1,
                                                                              max(n - 1, 0)])}
    t = rng.choice(list(range(16)) + [2**31, 2**32 - 1])
    raw = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 4, 8, 12, 16])))
    return {"op": "kv_raw", "key": enc(key), "type": t, "raw": enc(raw)}


def _gguf_tensor(rng: random.Random, gf) -> dict:
    experts = [t for t in gf.tensors if b"_exps" in t.name]
    t = rng.choice(experts if experts and rng.random() < 0.6 else gf.tensors)
    name = enc(t.name)
    r = rng.random()
    if r < 0.3:
        dims = list(t.dims)
        i = rng.randrange(len(dims))
        variants = [dims[:i] + [int_near(rng, dims[i])] + dims[i + 1:], dims + [1], dims + [rng.choice(INTS)],
                    dims[:-1], [], dims + [1, 1, 1], dims[::-1], [0] + dims[1:]]
        if len(dims) > 1 and dims[0] % 2 == 0:
            variants.append([dims[0] // 2, dims[1] * 2] + dims[2:])  # the same bytes, another shape
        return {"op": "tensor_set", "name": name, "field": "dims", "value": rng.choice(variants),
                **_relayout(rng)}
    if r < 0.45:
        value = rng.choice(BAD_GGML_TYPES) if rng.random() < 0.4 else rng.choice(GGML_TYPES)
        return {"op": "tensor_set", "name": name, "field": "type", "value": value, **_relayout(rng)}
    if r < 0.6:
        align = gf.alignment()
        other = rng.choice(gf.tensors).offset
        value = rng.choice([0, t.offset + 1, t.offset - 1, t.offset + align, len(gf.data), len(gf.data) - align,
                            2**63, 2**64 - align, other, int_near(rng, t.offset)])
        return {"op": "tensor_set", "name": name, "field": "offset", "value": value}
    if r < 0.75:
        s = t.name
        other = rng.choice(gf.tensors).name
        value = rng.choice([b"", s + b"\xff", b"\xc3" + s, b"x" * 63, b"x" * 64, b"x" * 65, s * 4, other,
                            s.replace(b".weight", b".lowbit"), s.replace(b".lowbit", b".weight"),
                            s.replace(b".weight", b""), b"blk.99.ffn_up_exps.weight", b"blk.-1.ffn_up_exps.weight",
                            b"blk.0.ffn_up_exps.lowbit", b"blk.99999999999999999999.ffn_up_exps.weight"])
        return {"op": "tensor_set", "name": name, "field": "name", "value": enc(value)}
    if r < 0.85:
        return {"op": rng.choice(["tensor_drop", "tensor_drop", "tensor_delete"]), "name": name}
    new = rng.choice([t.name, t.name.replace(b".weight", b".lowbit"), b"blk.0.attn_q.lowbit",
                      b"blk.7.ffn_up_exps.lowbit", b"blk.1.ffn_gate_up_exps.weight"])
    return {"op": rng.choice(["tensor_copy", "tensor_copy", "tensor_duplicate"]), "name": name, "as": enc(new)}


def _relayout(rng: random.Random) -> dict:
    """Mostly: lay the data out again, so that the change is not caught by ggml's offset check alone."""
    return {"relayout": True} if rng.random() < 0.7 else {}


def _gguf_data(rng: random.Random, gf, data: bytes, header_end: int) -> dict:
    r = rng.random()
    floats = [t for t in gf.tensors if t.type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)]
    if r < 0.5 and floats:
        t = rng.choice(floats)
        value = rng.choice(["nan", "inf", "-inf", 1e30, 0.0, 65504.0])
        return {"op": "tensor_fill", "name": enc(t.name), "value": value}
    if r < 0.8:
        keep = rng.choice([0, len(gf.data) - 1, len(gf.data) // 2, rng.randrange(max(len(gf.data), 1))])
        return {"op": "data_truncate", "keep": keep}
    return _bytes(rng, data, header_end, len(data))


# -- bytes --------------------------------------------------------------------------------------------

def _bytes(rng: random.Random, data: bytes, start: int, end: int) -> dict:
    """A byte-level op at a position in [start, end)."""
    at = rng.randrange(start, max(end, start + 1))
    r = rng.random()
    if r < 0.2:
        return {"op": "truncate", "at": at}
    if r < 0.7:
        n = rng.choice([1, 1, 2, 4, 8])
        b = bytes(rng.randrange(256) for _ in range(n)) if rng.random() < 0.5 else \
            bytes(c ^ (1 << rng.randrange(8)) for c in data[at:at + n])
        return {"op": "overwrite", "at": at, "bytes": enc(b or b"\xff")}
    if r < 0.9:
        b = rng.choice([b"\xff", b"\x00", b"\xef\xbb\xbf", b"\xc3", b"{", b'"'])
        return {"op": "insert", "at": at, "bytes": enc(b)}
    return {"op": "append", "bytes": enc(rng.choice([b"\x00" * 8, b"}", b"garbage", b"\xff" * 32]))}


# -- JSON ---------------------------------------------------------------------------------------------

def _paths(doc, limit: int = 400) -> list[list]:
    """Paths to values in doc (at most a few items of each list)."""
    out, stack = [], [([], doc)]
    while stack and len(out) < limit:
        path, value = stack.pop()
        if path:
            out.append(path)
        if isinstance(value, dict):
            stack += [(path + [k], v) for k, v in list(value.items())[:40]]
        elif isinstance(value, list):
            stack += [(path + [i], value[i]) for i in sorted({0, len(value) - 1, len(value) // 2}) if value]
    return out


def _get(doc, path):
    for key in path:
        doc = doc[key]
    return doc


def _json_doc_op(rng: random.Random, doc, kind: str) -> dict:
    paths = _paths(doc)
    important = [p for p in paths if any(p[:len(q)] == q for q in IMPORTANT_PATHS[kind])]
    if not paths:
        return {"op": "json_replace", "value": json_value(rng)}
    path = rng.choice(important if important and rng.random() < 0.7 else paths)
    old = _get(doc, path)
    r = rng.random()
    if r < 0.5:
        return {"op": "json_set", "path": path, "value": json_value(rng, old)}
    if r < 0.65:
        return {"op": "json_delete", "path": path}
    if r < 0.72 and isinstance(old, list):  # one more item
        return {"op": "json_set", "path": path + [len(old)], "value": json_value(rng, old[0] if old else None)}
    if r < 0.8 and isinstance(path[-1], str):
        return {"op": "json_rename", "path": path, "to": rng.choice(["", path[-1] + "\udcff", path[-1].upper(), "x"])}
    if r < 0.9:
        return {"op": "json_nest", "path": path, "depth": rng.choice([2, 64, 5000, 100000])}
    return {"op": "json_replace", "value": rng.choice([None, [], 1, "x", [doc], {"wrapped": doc}])}


def _json_file(rng: random.Random, data: bytes, kind: str) -> dict:
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    if doc is None or rng.random() < 0.25:
        return _bytes(rng, data, 0, len(data))
    return _json_doc_op(rng, doc, kind)


def _safetensors(rng: random.Random, data: bytes) -> dict:
    try:
        header, body = split_safetensors(data)
    except ValueError:
        return _bytes(rng, data, 0, len(data))
    n = len(data) - len(body)
    r = rng.random()
    if r < 0.1:
        return {"op": "st_header_length", "value": rng.choice([0, 1, 2, n - 9, n - 7, n + 1, len(data), 2**31,
                                                               2**63, 2**64 - 1])}
    if r < 0.25:
        return _bytes(rng, data, 0 if rng.random() < 0.7 else n, n if rng.random() < 0.7 else len(data))
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    r = rng.random()
    if r < 0.2:
        return {"op": "json_set", "path": [name, "dtype"],
                "value": rng.choice(["F16", "BF16", "F64", "I8", "BOOL", "F8_E4M3", "U32", "f32", "", "Q4_0", 7, None])}
    if r < 0.45:
        shape = entry["shape"]
        path = [name, "shape"] + ([rng.randrange(len(shape))] if shape and rng.random() < 0.7 else [])
        return {"op": "json_set", "path": path, "value": rng.choice(INTS + [[], [0], "64", 1.5, None, [[64]]])}
    if r < 0.7:
        begin, end = entry["data_offsets"]
        i = rng.randrange(2)
        value = rng.choice([0, -1, begin, end, end + 1, begin - 1, len(body), len(body) + 1, 2**63, 2**64, "0", None])
        return {"op": "json_set", "path": [name, "data_offsets", i], "value": value}
    if r < 0.8:
        return {"op": "json_delete", "path": [name] + rng.choice([[], ["dtype"], ["shape"], ["data_offsets"]])}
    if r < 0.9:
        to = rng.choice(["", name + ".extra", name.replace("weight", "bias"), "lm_head.weight", names[0], "\udcff"])
        return {"op": "json_rename", "path": [name], "to": to}
    return {"op": "json_set", "path": ["__metadata__"], "value": rng.choice([None, [], {"format": 1}, "pt", {"a": {}}])}
