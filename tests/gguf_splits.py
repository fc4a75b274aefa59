"""A GGUF split into shards as llama.cpp's llama-gguf-split writes them (NAME-00001-of-0000N.gguf:
every key in the first shard with split.no, split.count and split.tensors.count; the tensors spread
over the shards in order), written with gguf-py's own splitting writer."""
from __future__ import annotations

import math
from pathlib import Path

import gguf

from pyedgemoe.convert.from_gguf import copy_kv, open_gguf


def write_split(src: Path, out: Path, n_shards: int) -> list[Path]:
    """src's tensors and keys in n_shards shards named after out (out's stem-0000i-of-0000n.gguf);
    their paths, the first first. The writer pads each shard's data to gguf's default alignment,
    which the other shards' headers (split keys alone) imply; src's own is not copied."""
    reader = open_gguf(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, reader.get_field(gguf.Keys.General.ARCHITECTURE).contents(),
                             split_max_tensors=math.ceil(len(reader.tensors) / n_shards))
    copy_kv(reader, writer, skip=lambda key: False)
    write_tensors(reader, writer)
    shards = [out.with_name(f"{out.stem}-{i:05d}-of-{n_shards:05d}.gguf") for i in range(1, n_shards + 1)]
    assert all(p.is_file() for p in shards), sorted(out.parent.iterdir())
    return shards


def write_tensors(reader, writer: gguf.GGUFWriter) -> None:
    """reader's tensors written by writer after the keys given it, and its files closed."""
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
