"""A GGUF file as a structure the mutators can damage one field at a time, and its bytes again.

Unlike gguf-py's reader and writer, this keeps what a damaged file needs and a valid one never has:
keys and strings as raw bytes (not necessarily UTF-8), a value whose bytes disagree with its declared
type (`KV.raw`), header counts that lie (`GGUFFile.n_kv` / `n_tensors`), tensor infos pointing
anywhere. Serializing an unmutated parse gives back the same bytes (tests/test_fuzz_replay.py checks).

The layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 n_tensors, u64 n_kv; n_kv
key/values (u64-length key, u32 value type, value); n_tensors tensor infos (u64-length name, u32
n_dims, n_dims u64 dims, u32 ggml type, u64 offset relative to the data section); padding to
general.alignment (32 if absent); the data section.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from gguf import GGUFValueType as VT

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = b"general.alignment"

# value type -> struct format of one scalar
SCALAR_FORMATS = {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
    VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d",
}


@dataclass
class Array:
    item_type: int
    items: list


@dataclass
class KV:
    key: bytes
    type: int
    value: object = None  # int, float, bool, bytes (STRING) or Array
    raw: bytes | None = None  # if set: the bytes written after the type, whatever `type` says

    def value_bytes(self) -> bytes:
        return self.raw if self.raw is not None else pack_value(self.type, self.value)


@dataclass
class TensorInfo:
    name: bytes
    dims: list[int]
    type: int
    offset: int


@dataclass
class GGUFFile:
    version: int
    kvs: list[KV]
    tensors: list[TensorInfo]
    data: bytes  # the data section (starts at the first aligned offset after the header)
    magic: bytes = MAGIC
    n_kv: int | None = None  # declared counts when they lie; None: the true counts
    n_tensors: int | None = None
    padding: bytes | None = field(default=None, repr=False)  # as read; None: zeros to the alignment

    def kv(self, key: bytes) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    def tensor(self, name: bytes) -> TensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)

    def alignment(self) -> int:
        kv = self.kv(ALIGNMENT_KEY)
        if kv is not None and kv.raw is None and kv.type == VT.UINT32 and isinstance(kv.value, int) and kv.value > 0:
            return kv.value
        return DEFAULT_ALIGNMENT

    def header_bytes(self) -> bytes:
        out = bytearray(self.magic)
        out += struct.pack("<IQQ", self.version & 0xFFFFFFFF,
                           (len(self.tensors) if self.n_tensors is None else self.n_tensors) & (2**64 - 1),
                           (len(self.kvs) if self.n_kv is None else self.n_kv) & (2**64 - 1))
        for kv in self.kvs:
            out += pack_string(kv.key) + struct.pack("<I", kv.type & 0xFFFFFFFF) + kv.value_bytes()
        for t in self.tensors:
            out += pack_string(t.name) + struct.pack("<I", len(t.dims) & 0xFFFFFFFF)
            out += b"".join(struct.pack("<Q", d & (2**64 - 1)) for d in t.dims)
            out += struct.pack("<IQ", t.type & 0xFFFFFFFF, t.offset & (2**64 - 1))
        return bytes(out)

    def to_bytes(self) -> bytes:
        header = self.header_bytes()
        if self.padding is not None:
            padding = self.padding
        else:
            align = self.alignment()
            padding = b"\0" * (-len(header) % align)
        return header + padding + self.data


def pack_string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def pack_value(vtype: int, value) -> bytes:
    if vtype == VT.STRING:
        return pack_string(value)
    if vtype == VT.ARRAY:
        out = struct.pack("<IQ", value.item_type, len(value.items))
        return out + b"".join(pack_value(value.item_type, item) for item in value.items)
    fmt = SCALAR_FORMATS[VT(vtype)]
    if fmt[-1] in "fd":
        return struct.pack(fmt, float(value))
    if fmt[-1] == "?":
        return struct.pack("<B", int(value) & 0xFF)
    bits = struct.calcsize(fmt) * 8
    signed = fmt[-1].islower()
    v = int(value)
    v = ((v + 2 ** (bits - 1)) % 2**bits) - 2 ** (bits - 1) if signed else v % 2**bits
    return struct.pack(fmt, v)


class _Reader:
    def __init__(self, buf: bytes):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"GGUF ends at {len(self.buf)} bytes, needed {n} more at {self.pos}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        return self.take(self.unpack("<Q"))

    def value(self, vtype: int):
        if vtype == VT.STRING:
            return self.string()
        if vtype == VT.ARRAY:
            item_type, n = self.unpack("<I"), self.unpack("<Q")
            return Array(item_type, [self.value(item_type) for _ in range(n)])
        return self.unpack(SCALAR_FORMATS[VT(vtype)])


def parse(buf: bytes) -> GGUFFile:
    """A valid GGUF's structure (the seeds are valid; mutated files are never parsed again)."""
    r = _Reader(buf)
    magic = r.take(4)
    if magic != MAGIC:
        raise ValueError("not a GGUF file")
    version, n_tensors, n_kv = r.unpack("<I"), r.unpack("<Q"), r.unpack("<Q")
    kvs = []
    for _ in range(n_kv):
        key = r.string()
        vtype = r.unpack("<I")
        kvs.append(KV(key, vtype, r.value(vtype)))
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.unpack("<Q") for _ in range(r.unpack("<I"))]
        tensors.append(TensorInfo(name, dims, r.unpack("<I"), r.unpack("<Q")))
    gf = GGUFFile(version, kvs, tensors, b"")
    data_start = r.pos + (-r.pos % gf.alignment())
    gf.data = buf[data_start:]
    return gf
