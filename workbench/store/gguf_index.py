"""A GGUF's index: what a pack adds to a GGUF, in a small file, so the GGUF streams as it lies (no pack copy).

The index is a pack (workbench/store/pack.py, same header and checks) whose header names the GGUF as its data
file: each expert's three parts and every tensor the GGUF holds as one byte range point into the GGUF, with the
crc32 the reader checks; the few tensors made on read (GGUFModel's derived ones, deepseek2's joined kv_b, llama's
un-permuted Q/K rows) are stored in the index itself. Building it reads the GGUF once, in pieces of at most
`chunk` bytes (memory stays bounded whatever the GGUF's size), for the crc32s.
"""
from __future__ import annotations

import os
import struct
import time
import zlib
from pathlib import Path

from workbench import host
from workbench.atomic import atomic_path
from workbench.chat import find_template
from workbench.store.pack import ALIGN, FORMAT, MAGIC, PARTS, PREFIX, _align, _crc, _encode, _header_bytes, _nbytes, expert_shapes

CHUNK = 16 * 2**20


def _read_into(fd: int, buf: memoryview, offset: int) -> None:
    got = 0
    while got < len(buf):
        n = host.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            raise EOFError(f"end of file at byte {offset + got}")
        got += n


def _crcs(fd: int, buf: memoryview, ranges: list[tuple[int, int]], crcs: list[int]) -> None:
    """crcs[i] continued over the bytes of ranges[i] = (offset, n), reading runs of adjacent ranges of at most
    len(buf) bytes at once (a range longer than that in pieces). Read pages are dropped from the page cache
    (where the platform can: host.evict)."""
    i = 0
    while i < len(ranges):
        start, n = ranges[i]
        if n > len(buf):
            for at in range(0, n, len(buf)):
                k = min(len(buf), n - at)
                _read_into(fd, buf[:k], start + at)
                crcs[i] = zlib.crc32(buf[:k], crcs[i])
            host.evict(fd, start, n)
            i += 1
            continue
        j, end = i + 1, start + n
        while j < len(ranges) and ranges[j][0] == end and end + ranges[j][1] - start <= len(buf):
            end += ranges[j][1]
            j += 1
        _read_into(fd, buf[:end - start], start)
        for k in range(i, j):
            o, m = ranges[k]
            crcs[k] = zlib.crc32(buf[o - start:o - start + m], crcs[k])
        host.evict(fd, start, end - start)
        i = j


def build_index(src, dst, progress: bool = False, chunk: int = CHUNK) -> Path:
    """Index the GGUF at src into dst, atomically."""
    from workbench.models.gguf_model import GGUFModel

    model = GGUFModel(src)
    s, gguf, source = model.spec, Path(src).resolve(), model.source_info()
    st = gguf.stat()
    data = {"path": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns,           # what Pack checks it by
            "head_bytes": min(st.st_size, int(model.reader.data_offset)), "head_sha256": source["header_sha256"]}
    header = index_header(model, source, data)
    if text := model.tokenizer_json():
        header["tokenizer"] = text

    tensors, here = {}, []              # here: the tensors stored in the index (made on read)
    for name in model.names():
        shape, kind = tuple(model.tensor_shape(name)), model.tensor_kind(name)
        n, loc = _nbytes(shape, kind), model.tensor_location(name)
        tensors[name] = {"offset": 0, "nbytes": n, "shape": list(shape), "kind": kind, "crc32": "0" * 8}
        if loc is not None and loc[1] == n:
            tensors[name].update({"offset": loc[0], "in": "data"})
        else:
            here.append(name)
    header["tensors"] = tensors
    header["experts"] = experts_header(model, lambda L, e: {"parts": {p: list(o) for p, o in
                                                                      model.expert_location(L, e).items()}})
    layers = header["experts"]["layers"]

    buf = memoryview(bytearray(chunk))
    fd = os.open(gguf, os.O_RDONLY)
    try:
        names = sorted((n for n in tensors if n not in here), key=lambda n: tensors[n]["offset"])
        crcs = [0] * len(names)
        _crcs(fd, buf, [(tensors[n]["offset"], tensors[n]["nbytes"]) for n in names], crcs)
        for n, c in zip(names, crcs):
            tensors[n]["crc32"] = f"{c & 0xFFFFFFFF:08x}"
        for L in moe_layers(s, progress):
            ents = layers[str(L)]
            crcs = [0] * len(ents)
            for p in PARTS:             # each expert's crc32 runs over gate, up, down in turn
                _crcs(fd, buf, [tuple(ent["parts"][p]) for ent in ents], crcs)
            for ent, c in zip(ents, crcs):
                ent["crc32"] = f"{c & 0xFFFFFFFF:08x}"
    finally:
        os.close(fd)
    del buf

    return write_index(dst, header, tensors, here, lambda name: _encode(
        model.tensor_raw(name) if tensors[name]["kind"].startswith("gguf:") else model.tensor(name),
        tensors[name]["kind"]))


def index_header(model, source: dict, data) -> dict:
    """An index's header but its tensors and experts: the file(s) its data lies in (`data`), the source, its spec and
    chat template."""
    header = {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "source": source,
              "spec": model.spec.to_dict(), "layout": "native", "quant": {"experts": "raw", "rest": "raw"},
              "data": data}
    if template := find_template(model.path):
        header["chat_template"] = template
    return header


def moe_layers(s, progress: bool):
    """The MoE layers an index's crc pass walks, with a progress bar when asked."""
    if not progress:
        return s.moe_layers
    from tqdm.auto import tqdm
    return tqdm(s.moe_layers, desc="indexing experts", unit="layer")


def experts_header(model, where) -> dict:
    """An index's "experts" entry: their shapes, each layer's kinds and where each expert's parts lie (where(L, e):
    the entry's location fields; its crc32 is filled in by the caller's pass over the bytes)."""
    s = model.spec
    shapes = expert_shapes(s.hidden_size, s.moe_intermediate_size)
    layer_kinds = {str(L): model.expert_kinds(L) for L in s.moe_layers}
    layers = {str(L): [{**where(L, e), "crc32": "0" * 8} for e in range(s.num_experts)] for L in s.moe_layers}
    lsize = {L: sum(_nbytes(shapes[p], k[p]) for p in PARTS) for L, k in layer_kinds.items()}
    return {"shapes": {p: list(shapes[p]) for p in PARTS}, "kinds": layer_kinds[str(s.moe_layers[-1])],
            "layer_kinds": layer_kinds, "nbytes": max(lsize.values()), "total_nbytes": s.num_experts * sum(lsize.values()),
            "layers": layers}


def write_index(dst, header: dict, tensors: dict, here: list, payload) -> Path:
    """An index pack, atomically: its header, then the tensors it holds itself (`here`; payload(name): their
    encoded bytes, made one at a time: llama's permuted Q/K can be large) at 4 KiB-aligned offsets after it."""
    data_start = ALIGN
    while True:         # the header's length depends on the offsets it records: iterate to a fixed point
        off = data_start
        for name in here:
            tensors[name]["offset"] = off
            off = _align(off + tensors[name]["nbytes"])
        header["file_size"] = off
        need = _align(PREFIX + len(_header_bytes(header)))
        if need == data_start:
            break
        data_start = need
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dst) as tmp, open(tmp, "wb") as f:
        f.truncate(header["file_size"])
        for name in here:
            b = payload(name)
            tensors[name]["crc32"] = _crc(b)
            f.seek(tensors[name]["offset"])
            f.write(b)
        hb = _header_bytes(header)
        f.seek(0)
        f.write(MAGIC + struct.pack("<IQI", FORMAT, len(hb), zlib.crc32(hb)) + hb)
    return dst
