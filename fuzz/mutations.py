"""Applying a mutation: a small JSON-able recipe, `{"file": ..., "op": ..., <parameters>}`, turned
into new bytes for one file of an input. Applying is deterministic, so a recipe in
tests/fuzz_corpus/ reproduces its input from the seed; choosing recipes at random is generate.py's job.

How a file is understood follows its name: `*.gguf` is a GGUF (gguf_file.py), `*.safetensors` a
safetensors file (8-byte header length, JSON header, data), `*.json` a JSON document; the byte ops
(truncate, overwrite, insert, append) apply to any file.

Bytes in a recipe are a string when they are UTF-8, else `{"hex": "..."}` (keys, names, strings).
"""
from __future__ import annotations

import json
import math
import struct

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import GGUFValueType as VT

from fuzz import gguf_file
from fuzz.gguf_file import KV, Array, GGUFFile, TensorInfo

BYTE_OPS = ("truncate", "overwrite", "insert", "append")
GGUF_OPS = ("magic", "version", "count", "kv_set", "kv_raw", "kv_delete", "kv_rename", "kv_duplicate",
            "array_count", "array_keep", "string_length", "tensor_set", "tensor_delete", "tensor_drop",
            "tensor_duplicate", "tensor_copy",
            "tensor_fill", "data_truncate")
JSON_OPS = ("json_set", "json_delete", "json_rename", "json_replace", "json_nest")
SAFETENSORS_OPS = ("st_header_length",)  # plus the JSON ops, on its header


# -- bytes in recipes ------------------------------------------------------------------------------

def enc(b: bytes) -> str | dict:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return {"hex": b.hex()}


def dec(x: str | dict) -> bytes:
    return bytes.fromhex(x["hex"]) if isinstance(x, dict) else x.encode("utf-8", "surrogatepass")


# -- applying -----------------------------------------------------------------------------------------

def apply(files: dict[str, bytes], mutations: list[dict]) -> dict[str, bytes]:
    """The input's files after the mutations, in order (files not named keep their bytes)."""
    files = dict(files)
    for m in mutations:
        name = m["file"]
        files[name] = apply_one(name, files[name], m)
    return files


def apply_one(name: str, data: bytes, m: dict) -> bytes:
    op = m["op"]
    if op in BYTE_OPS:
        return _byte_op(data, m)
    if name.endswith(".gguf") and op in GGUF_OPS:
        gf = gguf_file.parse(data)
        _GGUF_APPLY[op](gf, m)
        return gf.to_bytes()
    if name.endswith(".safetensors") and (op in JSON_OPS or op in SAFETENSORS_OPS):
        return _safetensors_op(data, m)
    if name.endswith(".json") and op in JSON_OPS:
        return _json_op(data, m)
    raise ValueError(f"mutation {op} does not apply to {name}")


def _byte_op(data: bytes, m: dict) -> bytes:
    op = m["op"]
    if op == "truncate":
        return data[:m["at"]]
    if op == "append":
        return data + dec(m["bytes"])
    b, at = dec(m["bytes"]), min(m["at"], len(data))
    if op == "overwrite":
        return data[:at] + b + data[at + len(b):]
    return data[:at] + b + data[at:]  # insert


# -- GGUF ---------------------------------------------------------------------------------------------

def _kv(gf: GGUFFile, m: dict) -> KV:
    kv = gf.kv(dec(m["key"]))
    if kv is None:
        raise ValueError(f"no key {m['key']!r} in the GGUF")
    return kv


def _tensor(gf: GGUFFile, m: dict) -> TensorInfo:
    t = gf.tensor(dec(m["name"]))
    if t is None:
        raise ValueError(f"no tensor {m['name']!r} in the GGUF")
    return t


def value_from_recipe(vtype: int, value):
    """A recipe's value for a GGUF value of type vtype: strings as enc() bytes, arrays as
    {"item_type", "items"}, floats possibly "nan"/"inf" (JSON has neither)."""
    if vtype == VT.STRING:
        return dec(value)
    if vtype == VT.ARRAY:
        return Array(value["item_type"], [value_from_recipe(value["item_type"], v) for v in value["items"]])
    if isinstance(value, str):
        return float(value)
    return value


def _set_kv(gf: GGUFFile, m: dict) -> None:
    key = dec(m["key"])
    new = KV(key, m["type"], value_from_recipe(m["type"], m["value"]))
    for i, kv in enumerate(gf.kvs):
        if kv.key == key:
            gf.kvs[i] = new
            return
    gf.kvs.append(new)


def _raw_kv(gf: GGUFFile, m: dict) -> None:
    key = dec(m["key"])
    new = KV(key, m["type"], raw=dec(m["raw"]))
    for i, kv in enumerate(gf.kvs):
        if kv.key == key:
            gf.kvs[i] = new
            return
    gf.kvs.append(new)


def _array_count(gf: GGUFFile, m: dict) -> None:
    """The array keeps its items but declares `count` of them."""
    kv = _kv(gf, m)
    items = b"".join(gguf_file.pack_value(kv.value.item_type, v) for v in kv.value.items)
    kv.raw = struct.pack("<IQ", kv.value.item_type, m["count"] % 2**64) + items


def _array_keep(gf: GGUFFile, m: dict) -> None:
    """The array really holds only its first `keep` items (a vocabulary shorter than its scores...)."""
    kv = _kv(gf, m)
    kv.value = Array(kv.value.item_type, kv.value.items[:m["keep"]])


def _string_length(gf: GGUFFile, m: dict) -> None:
    """The string keeps its bytes but declares `length` of them."""
    kv = _kv(gf, m)
    kv.raw = struct.pack("<Q", m["length"] % 2**64) + kv.value


def _rename_kv(gf: GGUFFile, m: dict) -> None:
    _kv(gf, m).key = dec(m["to"])


def _tensor_set(gf: GGUFFile, m: dict) -> None:
    """One field of a tensor's info. With "relayout", the data section is then laid out again for the
    new sizes where it can be (relayout()), so that only the field is wrong and not every later
    tensor's offset too: ggml's parser refuses offsets that are not where the sizes before them put them."""
    t, value = _tensor(gf, m), m["value"]
    if m["field"] == "name":
        t.name = dec(value)
    elif m["field"] == "dims":
        t.dims = list(value)
    else:
        setattr(t, m["field"], value)  # type, offset
    if m.get("relayout"):
        try:
            relayout(gf)
        except (ValueError, KeyError):  # sizes that cannot be laid out (an unknown type, huge dims): as set
            pass


def tensor_nbytes(t: TensorInfo) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.type)]
    if t.dims and t.dims[0] % block:
        raise ValueError(f"row of {t.dims[0]} is not a whole number of {block}-element blocks")
    return math.prod(t.dims) // block * size


MAX_RELAYOUT_BYTES = 64 << 20


def relayout(gf: GGUFFile) -> None:
    """Offsets as ggml expects them (each tensor after the one before, padded to the alignment),
    each tensor's bytes taken from its old offset at its new size (zeros past the end)."""
    align, data, pos = gf.alignment(), bytearray(), 0
    sizes = [tensor_nbytes(t) for t in gf.tensors]
    if sum(sizes) > MAX_RELAYOUT_BYTES:
        raise ValueError("tensors too large to lay out")
    for t, n in zip(gf.tensors, sizes):
        chunk = gf.data[t.offset:t.offset + n] if 0 <= t.offset < len(gf.data) else b""
        t.offset = pos
        data += chunk + b"\0" * (n - len(chunk))
        data += b"\0" * (-len(data) % align)
        pos = len(data)
    gf.data = bytes(data)


def _tensor_drop(gf: GGUFFile, m: dict) -> None:
    """The tensor gone, its info and its bytes (the file stays consistent otherwise)."""
    gf.tensors.remove(_tensor(gf, m))
    relayout(gf)


def _tensor_copy(gf: GGUFFile, m: dict) -> None:
    """Another tensor with the same dims, type and bytes, named `as`, at the end of the data."""
    t = _tensor(gf, m)
    gf.tensors.append(TensorInfo(dec(m.get("as", m["name"])), list(t.dims), t.type, t.offset))
    relayout(gf)


def _tensor_fill(gf: GGUFFile, m: dict) -> None:
    """Every element of an f32/f16 tensor set to `value` (NaN, inf, a huge number...)."""
    t = _tensor(gf, m)
    fmt = {int(GGMLQuantizationType.F32): "<f", int(GGMLQuantizationType.F16): "<e"}[t.type]
    value = float(m["value"])
    try:
        element = struct.pack(fmt, value)
    except OverflowError:  # too big for f16
        element = struct.pack(fmt, math.copysign(math.inf, value))
    n = math.prod(t.dims)
    gf.data = gf.data[:t.offset] + element * n + gf.data[t.offset + n * len(element):]


def _set_attr(name):
    def set_(gf: GGUFFile, m: dict) -> None:
        setattr(gf, name, dec(m["value"]) if name == "magic" else m["value"])
    return set_


_GGUF_APPLY = {
    "magic": _set_attr("magic"),
    "version": _set_attr("version"),
    "count": lambda gf, m: setattr(gf, m["field"], m["value"]),
    "kv_set": _set_kv,
    "kv_raw": _raw_kv,
    "kv_delete": lambda gf, m: gf.kvs.remove(_kv(gf, m)),
    "kv_rename": _rename_kv,
    "kv_duplicate": lambda gf, m: gf.kvs.append(_kv(gf, m)),
    "array_count": _array_count,
    "array_keep": _array_keep,
    "string_length": _string_length,
    "tensor_set": _tensor_set,
    "tensor_delete": lambda gf, m: gf.tensors.remove(_tensor(gf, m)),  # its info only
    "tensor_drop": _tensor_drop,
    "tensor_duplicate": lambda gf, m: gf.tensors.append(  # its info, pointing at the same bytes
        TensorInfo(**{**vars(_tensor(gf, m)), "name": dec(m.get("as", m["name"]))})),
    "tensor_copy": _tensor_copy,
    "tensor_fill": _tensor_fill,
    "data_truncate": lambda gf, m: setattr(gf, "data", gf.data[:m["keep"]]),
}


# -- JSON ---------------------------------------------------------------------------------------------

NEST_MARK = "@@fuzz-nest@@"  # a string value that json_nest's nesting replaces in the text


def json_value(value):
    """Recipe values "nan", "inf", "-inf" under {"float": ...}: JSON itself has no such numbers."""
    if isinstance(value, dict) and set(value) == {"float"}:
        return float(value["float"])
    return value


def _walk(doc, path: list):
    """The container holding path[-1], and that last key (an int index for lists)."""
    for key in path[:-1]:
        doc = doc[int(key)] if isinstance(doc, list) else doc[key]
    last = path[-1]
    return doc, int(last) if isinstance(doc, list) else last


def mutate_json(doc, m: dict) -> tuple[object, int | None]:
    """The document after a JSON op, and the nesting depth to substitute for NEST_MARK (json_nest)."""
    op = m["op"]
    if op == "json_replace":
        return json_value(m["value"]), None
    if op == "json_nest":
        value, depth = NEST_MARK, m["depth"]
    else:
        value, depth = json_value(m.get("value")), None
    if not m["path"]:
        return (value if op != "json_delete" else None), depth
    holder, key = _walk(doc, m["path"])
    if op == "json_delete":
        del holder[key]
    elif op == "json_rename":
        holder[m["to"]] = holder.pop(key)
    elif isinstance(holder, list) and key == len(holder):
        holder.append(value)
    else:
        holder[key] = value
    return doc, depth


def dump_json(doc, depth: int | None) -> str:
    text = json.dumps(doc, indent=1, ensure_ascii=False)
    if depth is not None:
        text = text.replace(json.dumps(NEST_MARK), "[" * depth + "]" * depth, 1)
    return text


def _json_op(data: bytes, m: dict) -> bytes:
    doc, depth = mutate_json(json.loads(data), m)
    return dump_json(doc, depth).encode("utf-8", "surrogatepass")


# -- safetensors ---------------------------------------------------------------------------------------

def split_safetensors(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def _safetensors_op(data: bytes, m: dict) -> bytes:
    if m["op"] == "st_header_length":
        return struct.pack("<Q", m["value"] % 2**64) + data[8:]
    header, body = split_safetensors(data)
    doc, depth = mutate_json(header, m)
    text = dump_json(doc, depth).encode("utf-8", "surrogatepass")
    text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes
    return struct.pack("<Q", len(text)) + text + body
