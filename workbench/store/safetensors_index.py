"""The index of a safetensors checkpoint, in MLX's layout or a Hugging Face directory's bf16/f16/f32: a pack header
(workbench/store/pack.py) naming the safetensors files (one, or each shard) as its data files, so the checkpoint
streams as it lies (no pack copy): each run's offset names its shard (pack.at_shard), and the index is refused
once any shard changes (size, mtime, a hash of its header).

Every tensor and each expert's gate, up and down are "runs" into those files (an affine matrix: its codes, scales
and biases, each where it lies; a float one: its one range), with the crc32 the reader checks, read once here in
pieces of at most `chunk` bytes (workbench/store/gguf_index.py's _crcs). The few tensors the model changes on read
(the hybrid family's zero-centred norms) are stored in the index, f32; nothing else is: a few hundred KB for a model
of thousands of experts. The tokenizer stays beside the checkpoint (registry.tokenizer_for reads it from there).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.store.gguf_index import CHUNK, _crcs, experts_header, index_header, moe_layers, write_index
from workbench.store.pack import PARTS, SHARD_BITS, SHARD_MASK, _encode, _nbytes, at_shard


def in_place(model) -> bool:
    """Whether the checkpoint (an HFModel or MLXModel) streams as it lies: experts in a kind the engines read (MLX's
    affine codes, bf16, f16, f32), in one safetensors file or several."""
    return all(k is not None for L in model.spec.moe_layers[:1] for k in model.expert_kinds(L).values())


def data_file(shard) -> dict:
    """What an index records of a safetensors file to refuse it once it changes (workbench/store/pack.py)."""
    st = shard.path.stat()
    with open(shard.path, "rb") as f:
        head = f.read(shard.base)
    return {"path": str(shard.path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "head_bytes": shard.base, "head_sha256": hashlib.sha256(head).hexdigest()}


def build_index(src, dst, progress: bool = False, chunk: int = CHUNK) -> Path:
    """Index the safetensors checkpoint directory at src (MLX's layout or a Hugging Face directory, one file or
    several shards) into dst, atomically."""
    from workbench.store.pack import open_model

    model = open_model(src)
    if not in_place(model):
        raise WorkbenchError(f"{model.path}: its experts are {model.expert_kinds(model.spec.moe_layers[0])}: not "
                             f"streamed as they lie; convert it (python -m workbench convert {model.path} OUT)")
    s = model.spec
    shard_no = {id(sh): i for i, sh in enumerate(model.shards)}

    def at(runs) -> list:               # [(shard, file offset, bytes)] -> [[offset into the shards, bytes]]
        return [[at_shard(shard_no[id(sh)], off), n] for sh, off, n in runs]
    header = index_header(model, model.source_info(), [data_file(sh) for sh in model.shards])

    tensors, here = {}, []             # here: the tensors stored in the index (changed on read), f32
    for name in model.names():
        shape, runs = list(model.tensor_shape(name)), model.tensor_runs(name)
        kind = model.tensor_kind(name) if runs else "f32"
        tensors[name] = {"offset": 0, "nbytes": _nbytes(tuple(shape), kind), "shape": shape, "kind": kind,
                         "crc32": "0" * 8}
        if runs:
            tensors[name].update(offset=at(runs)[0][0], **{"in": "data", "runs": at(runs)})
        else:
            here.append(name)
    header["tensors"] = tensors
    header["experts"] = experts_header(model, lambda L, e: {"runs": {p: at(rs) for p, rs in
                                                                     model.expert_runs(L, e).items()}})
    layers = header["experts"]["layers"]

    buf = memoryview(bytearray(chunk))
    fds = []
    try:
        for sh in model.shards:
            fds.append(os.open(sh.path, os.O_RDONLY))
        for name, t in tensors.items():     # a tensor's crc32 runs over its codes, scales, biases in turn
            if name in here:
                continue
            crc = [0]
            for run in t["runs"]:
                _shard_crcs(fds, buf, [run], crc, model.shards)
            t["crc32"] = f"{crc[0] & 0xFFFFFFFF:08x}"
        for L in moe_layers(s, progress):
            ents = layers[str(L)]
            crcs = [0] * len(ents)
            for p in PARTS:
                for j in range(len(ents[0]["runs"][p])):
                    _shard_crcs(fds, buf, [ent["runs"][p][j] for ent in ents], crcs, model.shards)
            for ent, c in zip(ents, crcs):
                ent["crc32"] = f"{c & 0xFFFFFFFF:08x}"
    finally:
        for fd in fds:
            os.close(fd)

    return write_index(dst, header, tensors, here, lambda name: _encode(model.tensor(name), "f32"))


def _shard_crcs(fds: list[int], buf: memoryview, runs: list, crcs: list[int], shards) -> None:
    """crcs[i] continued over runs[i] = [offset into the shards (at_shard), bytes], each shard's runs read
    together (gguf_index._crcs); a shard that ends early is one line naming it."""
    for k, fd in enumerate(fds):
        mine = [i for i, (o, _) in enumerate(runs) if o >> SHARD_BITS == k]
        if not mine:
            continue
        sub = [crcs[i] for i in mine]
        try:
            _crcs(fd, buf, [(runs[i][0] & SHARD_MASK, runs[i][1]) for i in mine], sub)
        except EOFError as e:
            raise WorkbenchError(f"{shards[k].path}: truncated ({e})") from None
        for i, c in zip(mine, sub):
            crcs[i] = c
