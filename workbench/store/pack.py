"""The expert pack: one file, a JSON header, non-expert tensors, then per-layer expert regions.

    bytes 0-7    b"MOEPACK\\0"
    bytes 8-11   format version (u32 little-endian)
    bytes 12-19  header length (u64)
    bytes 20-23  crc32 of the header bytes (u32), checked before anything in the header is used
    header       UTF-8 JSON: source, spec, layout, quant, tensors, experts (offsets, sizes, crc32)
    data         from the first 4 KiB boundary after the header

Layouts:
  contiguous  one expert's gate|up|down adjacent, a layer's experts adjacent, each expert 4 KiB
              aligned and padded, so one expert is one read and neighbours merge into one.
  native      the projections in separate regions per layer (all gates, all ups, all downs), as
              in the source checkpoint: one expert is three scattered reads.

Every tensor and every expert carries a crc32; the reader checks it on every load.

A GGUF index (workbench/store/gguf_index.py) is a pack whose header names a data file, the GGUF itself
("data": path, size, mtime, a hash of its header): its experts and most tensors are read where they lie in
the GGUF (tensors marked "in": "data"), at the GGUF's 32-byte alignment, not 4 KiB; the few tensors the GGUF
does not hold as one range (derived, joined, rows permuted) are stored in the index. It is refused once the
GGUF changes. An index of a safetensors checkpoint (workbench/store/safetensors_index.py) is the same with its
safetensors files as its data files ("data": a list, one entry a shard), and every tensor and expert part there
one to three runs ("runs": codes, scales, biases, where they lie): an expert is up to nine reads. An offset into
the data files names its file in its high bits: byte o of shard i is at_shard(i, o) = i << SHARD_BITS | o, so a
read never spans two files and each keeps its place in the 4 KiB pages of its own file.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from isal import isal_zlib

from workbench.atomic import atomic_path
from workbench.chat import find_template
from workbench.errors import WorkbenchError
from workbench.io import SHARD_BITS, SHARD_MASK, crc_of_runs
from workbench.spec import MoESpec
from workbench.store import ggml_blocks, quant

MAGIC = b"MOEPACK\0"
FORMAT = 2          # 2: the header carries its own crc32 (format 1 packs are refused: re-convert)
PREFIX = 24
ALIGN = 4096
PARTS = ("gate", "up", "down")


def expert_shapes(d: int, ff: int) -> dict[str, tuple]:
    """One expert's matrices (rows, columns) at hidden size d and expert width ff."""
    return {"gate": (ff, d), "up": (ff, d), "down": (d, ff)}
EXPERT_KINDS = ("q2", "q3", "q4", "q8", "bf16", "raw", *ggml_blocks.BLOCKS)
REST_KINDS = ("q4", "q8", "bf16", "raw")
CONVERT_WINDOW = 64     # experts encoded at once (in parallel) before they are written
# "raw" (GGUF sources only): keep the source's own blocks byte for byte, as kinds "gguf:<TYPE>" (e.g.
# gguf:Q4_K), dequantized on load by the gguf package (workbench/models/gguf_model.py).
# g2, g3, g4, g8 (any source): the experts quantized into ggml's own block types, kinds "gguf:<TYPE>" too
# (workbench/store/ggml_blocks.py).


def at_shard(i: int, offset: int) -> int:
    """Byte `offset` of data file i, as an index's offsets name it."""
    return i << SHARD_BITS | offset


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def _inside(offset, n, size: int) -> bool:
    return type(offset) is int and type(n) is int and 0 <= offset and 0 <= n and offset + n <= size


def _crc(buf) -> str:
    return f"{isal_zlib.crc32(buf) & 0xFFFFFFFF:08x}"


def tensor_kind(name: str, shape: tuple, rest: str) -> str:
    """Quantize matrices; keep norms, biases and the router (it decides routing) in f32."""
    if len(shape) != 2 or name.endswith(("router", "shared_gate")):
        return "f32"
    return rest if rest == "bf16" or shape[1] % quant.GROUP == 0 else "bf16"


def expert_kind(shape: tuple, experts: str) -> str:
    if experts in ggml_blocks.BLOCKS:
        return ggml_blocks.block_kind(experts, shape[1])
    return experts if experts == "bf16" or shape[1] % quant.GROUP == 0 else "bf16"


def expert_kinds(shapes: dict, experts: str) -> dict[str, str]:
    """{part: kind} of an expert at `experts`. ggml's kernels compute an expert only whole, so where one of its
    matrices' rows does not split into ggml's 32-blocks every part stays in the affine format at the same bits."""
    if experts in ggml_blocks.BLOCKS and any(shapes[p][1] % ggml_blocks.SMALL for p in PARTS):
        experts = "q" + experts[1:]
    return {p: expert_kind(shapes[p], experts) for p in PARTS}


# f32 (norms, biases, the router) is stored raw and may be any rank; the rest goes through the codecs.
def _encode(a: np.ndarray, kind: str) -> np.ndarray:
    if kind.startswith(("gguf:", "mlx:")) and a.dtype == np.uint8:   # a GGUF's or MLX's own bytes: passed through
        return np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    if kind.startswith("gguf:"):                    # float weights into ggml's blocks (--experts g2..g8)
        return ggml_blocks.quantize(a, kind).reshape(-1)
    if kind == "f32":
        return np.ascontiguousarray(a, dtype=np.float32).reshape(-1).view(np.uint8)
    return quant.encode(np.ascontiguousarray(a, dtype=np.float32), kind)   # derived tensors may be views


def _decode(buf: np.ndarray, shape: tuple, kind: str) -> np.ndarray:
    if kind.startswith("gguf:"):
        from workbench.models.gguf_model import dequantize
        return dequantize(buf, kind[5:], shape)
    if kind == "f32":
        return buf.view(np.float32).reshape(shape)
    return quant.decode(buf, shape, kind)


def _nbytes(shape: tuple, kind: str) -> int:
    if kind.startswith("gguf:"):
        from workbench.models.gguf_model import row_nbytes
        return int(np.prod(shape[:-1])) * row_nbytes(kind[5:], shape[-1])
    return 4 * int(np.prod(shape)) if kind == "f32" else quant.encoded_nbytes(shape, kind)


# ---------------------------------------------------------------- writing

def _plan(model, layout: str, experts: str, rest: str, data_start: int):
    s = model.spec
    d, ff = s.hidden_size, s.moe_intermediate_size
    shapes = expert_shapes(d, ff)
    kinds = expert_kinds(shapes, experts) if experts != "raw" else {}
    sizes = {p: _nbytes(shapes[p], kinds[p]) for p in kinds}
    layer_kinds = {}                                  # raw: each layer keeps its source's types (Q4_K_M mixes)
    off = data_start
    tensors = {}
    for name, t in planned_tensors({n: model.tensor_shape(n) for n in model.names()}, rest, model.tensor_kind).items():
        tensors[name] = {"offset": off, "nbytes": t["nbytes"], "shape": t["shape"], "kind": t["kind"], "crc32": "0" * 8}
        off = _align(off + t["nbytes"])
    layers = {}
    for i in s.moe_layers:
        if experts == "raw":
            layer_kinds[str(i)] = kinds = model.expert_kinds(i)
            sizes = {p: _nbytes(shapes[p], kinds[p]) for p in PARTS}
        entries = [{"parts": {}, "crc32": "0" * 8} for _ in range(s.num_experts)]
        if layout == "contiguous":
            for ent in entries:
                start = off
                for p in PARTS:
                    ent["parts"][p] = [off, sizes[p]]
                    off += sizes[p]
                off = _align(off)
                ent["span"] = [start, off - start]
        else:
            for p in PARTS:
                for ent in entries:
                    ent["parts"][p] = [off, sizes[p]]
                    off = _align(off + sizes[p])
        layers[str(i)] = entries
    expert_info = {"shapes": {p: list(shapes[p]) for p in PARTS}, "kinds": kinds, "nbytes": sum(sizes.values()),
                   "layers": layers}
    if layer_kinds:
        lsize = {L: sum(_nbytes(shapes[p], k[p]) for p in PARTS) for L, k in layer_kinds.items()}
        expert_info.update(layer_kinds=layer_kinds, nbytes=max(lsize.values()),
                           total_nbytes=s.num_experts * sum(lsize.values()))
    return tensors, expert_info, off


def planned_tensors(shapes: dict, rest: str, own_kind=None) -> dict:
    """{name: {"shape", "kind", "nbytes"}} of the non-expert tensors a pack at precision `rest` holds, from their
    shapes alone (a checkpoint not yet converted, or its config.json: runtime.plan); at rest "raw", each keeps the
    source's kind, own_kind(name)."""
    kind = (lambda n, sh: own_kind(n)) if rest == "raw" else (lambda n, sh: tensor_kind(n, sh, rest))
    return {n: {"shape": list(sh), "kind": (k := kind(n, tuple(sh))), "nbytes": _nbytes(tuple(sh), k)}
            for n, sh in shapes.items()}


def planned_size(model, layout: str, experts: str, rest: str) -> int:
    """The bytes convert would write for `model` (its header's few KB aside): said before a pack is written."""
    return _plan(model, layout, experts, rest, ALIGN)[2]


def _header_bytes(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def open_model(src):
    """The reader of a checkpoint: a GGUF (workbench/models/gguf_model.py), a directory in MLX's layout
    (workbench/models/mlx_layout.py) or a Hugging Face directory (workbench/models/hf.py)."""
    if str(src).endswith(".gguf"):
        from workbench.models.gguf_model import GGUFModel
        return GGUFModel(src)
    from workbench.models.hf import HFModel
    from workbench.models.mlx_layout import MLXModel, is_mlx_layout
    return MLXModel(src) if is_mlx_layout(src) else HFModel(src)


def convert(src, dst, layout: str = "contiguous", experts: str = "q4", rest: str = "q4", progress: bool = False) -> Path:
    """Stream a checkpoint into a pack at dst, atomically (temp name, fsync, rename)."""
    if layout not in ("contiguous", "native"):
        raise WorkbenchError(f"--layout {layout!r}: choose contiguous or native")
    if experts not in EXPERT_KINDS:
        raise WorkbenchError(f"--experts {experts!r}: choose one of {', '.join(EXPERT_KINDS)}")
    if rest not in REST_KINDS:
        raise WorkbenchError(f"--rest {rest!r}: choose one of {', '.join(REST_KINDS)}")
    model = src if hasattr(src, "spec") else open_model(src)
    if "raw" in (experts, rest) and not hasattr(model, "expert_raw"):
        raise WorkbenchError(f"{model.path}: --experts/--rest raw keep a GGUF's or an MLX checkpoint's own blocks; "
                             f"this source is neither")
    if experts in ggml_blocks.BLOCKS and not ggml_blocks.available():
        raise WorkbenchError(f"--experts {experts}: ggml's block formats need llama-cpp-python and gguf: "
                             f"pip install 'moe-workbench[llamacpp]' (or convert with --experts q{experts[1:]})")
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    source = model.source_info() if hasattr(model, "source_info") else \
        {"path": str(Path(model.path).resolve()),
         "config_sha256": hashlib.sha256((Path(model.path) / "config.json").read_bytes()).hexdigest()}
    header = {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "source": source, "spec": model.spec.to_dict(), "layout": layout, "quant": {"experts": experts, "rest": rest}}
    tok = Path(model.path) / "tokenizer.json"
    if hasattr(model, "tokenizer_json"):           # GGUF: the vocabulary is in the file's metadata
        if text := model.tokenizer_json():
            header["tokenizer"] = text
    elif tok.exists():  # carried in the header so a pack is self-contained
        header["tokenizer"] = tok.read_text(encoding="utf-8")
    if template := find_template(model.path):
        header["chat_template"] = template
    data_start = ALIGN
    while True:  # the header's length depends on the offsets it records: iterate to a fixed point
        tensors, expert_info, end = _plan(model, layout, experts, rest, data_start)
        header.update(tensors=tensors, experts=expert_info, file_size=end)
        need = _align(PREFIX + len(_header_bytes(header)))
        if need == data_start:
            break
        data_start = need
    with atomic_path(dst) as tmp, open(tmp, "wb") as f:
        f.truncate(end)
        for name, t in tensors.items():
            buf = _encode(model.tensor_raw(name) if t["kind"].startswith(("gguf:", "mlx:")) else model.tensor(name),
                          t["kind"])
            t["crc32"] = _crc(buf)
            f.seek(t["offset"])
            f.write(buf)
        layers = expert_info["layers"]
        items = [(int(i), e) for i in layers for e in range(model.spec.num_experts)]

        def encoded(item) -> dict:
            i, e = item
            if experts == "raw":
                return model.expert_raw(i, e)                             # raw: the GGUF's bytes
            kinds = expert_info.get("layer_kinds", {}).get(str(i), expert_info["kinds"])
            w = model.expert(i, e)
            return {p: _encode(w[p], kinds[p]) for p in PARTS}

        bar = iter(_progress(items, progress, "experts"))
        # quantizing is most of a conversion (ggml's Q2_K: ~11 M weights/s a core), and ggml's quantizer and numpy's
        # large operations let go of the GIL: every core encodes, a window of experts at a time, written in order
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            for at in range(0, len(items), CONVERT_WINDOW):
                window = items[at:at + CONVERT_WINDOW]
                for (i, e), bufs in zip(window, pool.map(encoded, window)):
                    next(bar, None)
                    ent, crc = layers[str(i)][e], 0
                    for p in PARTS:
                        crc = isal_zlib.crc32(bufs[p], crc)
                        f.seek(ent["parts"][p][0])
                        f.write(bufs[p])
                    ent["crc32"] = f"{crc & 0xFFFFFFFF:08x}"
        hb = _header_bytes(header)
        f.seek(0)
        f.write(MAGIC + struct.pack("<IQI", FORMAT, len(hb), isal_zlib.crc32(hb)) + hb)
    return dst


def _progress(items, on: bool, what: str):
    if not on:
        return items
    from tqdm.auto import tqdm
    return tqdm(items, desc=f"converting {what}", unit="expert")


# ---------------------------------------------------------------- reading

def _part_runs(ent: dict) -> dict[str, list[tuple[int, int]]]:
    """{part: [(offset, bytes)]} of one expert entry: one run a part, or an MLX index's codes, scales, biases."""
    if "runs" in ent:
        return {p: [tuple(r) for r in ent["runs"][p]] for p in PARTS}
    return {p: [tuple(ent["parts"][p])] for p in PARTS}


class Pack:
    """An expert pack opened for reading: header parsed and checked against the file."""

    def __init__(self, path):
        self.path = Path(path)
        self.header = h = self._read_header()
        size = self.path.stat().st_size
        try:
            if size < h["file_size"]:
                raise WorkbenchError(f"{self.path}: truncated: {size} bytes, header says {h['file_size']}")
            data = h.get("data", [])
            files = [self._data_file(d) for d in (data if isinstance(data, list) else [data])] or \
                [(self.path, min(size, h["file_size"]))]
            self.data_paths = [p for p, _ in files]     # the files the experts lie in: the pack, or an index's
            self._parse(h)
            self._check(min(size, h["file_size"]), [n for _, n in files])
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            # the checksum matched, so the writer itself wrote a header this reader does not understand
            raise WorkbenchError(f"{self.path}: pack header is malformed ({type(e).__name__}: {e}); re-convert") from None

    def _read_header(self) -> dict:
        try:
            with open(self.path, "rb") as f:
                pre = f.read(PREFIX)
                if len(pre) < 20 or pre[:8] != MAGIC:
                    raise WorkbenchError(f"{self.path}: not an expert pack (bad magic)")
                version, n = struct.unpack("<IQ", pre[8:20])
                if version > FORMAT:
                    raise WorkbenchError(f"{self.path}: pack format {version} is newer than this workbench reads ({FORMAT}); "
                                         f"upgrade the workbench or re-convert")
                if version < FORMAT:
                    raise WorkbenchError(f"{self.path}: pack format {version} has no header checksum; re-convert it "
                                         f"(python -m workbench convert SOURCE {self.path})")
                size = os.fstat(f.fileno()).st_size
                if len(pre) < PREFIX or PREFIX + n > size:    # checked before a read sized by the header
                    raise WorkbenchError(f"{self.path}: truncated: header of {n} bytes, file has {size}")
                hb = f.read(n)
        except OSError as e:
            raise WorkbenchError(f"{self.path}: cannot read ({e.strerror})") from None
        if _crc(hb) != f"{struct.unpack('<I', pre[20:24])[0]:08x}":
            raise WorkbenchError(f"{self.path}: checksum mismatch in the pack header (corrupt pack)")
        try:
            header = json.loads(hb)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise WorkbenchError(f"{self.path}: header is not valid JSON (corrupt pack)") from None
        if not isinstance(header, dict):
            raise WorkbenchError(f"{self.path}: header is not a JSON object (corrupt pack)")
        return header

    def _data_file(self, d: dict) -> tuple[Path, int]:
        """A file an index's experts and tensors lie in (its GGUF, a safetensors shard) and its size, if it is the
        one indexed."""
        p = Path(d["path"])
        try:
            st = p.stat()
            with open(p, "rb") as f:
                head = f.read(d["head_bytes"])
        except OSError as e:
            raise WorkbenchError(f"{p}: cannot read it ({e.strerror}), a data file of the index {self.path}; delete "
                                 f"the index to rebuild it") from None
        if (st.st_size, st.st_mtime_ns, hashlib.sha256(head).hexdigest()) != (d["size"], d["mtime_ns"],
                                                                              d["head_sha256"]):
            raise WorkbenchError(f"{self.path}: {p} changed since this index was made; delete the index to rebuild it")
        return p, st.st_size

    def _parse(self, h: dict):
        self.spec = MoESpec.from_dict(h["spec"])
        self.layout = h["layout"]
        self.quant = h["quant"]
        self.tensors = h["tensors"]
        ex = h["experts"]
        self.expert_shapes = {p: tuple(ex["shapes"][p]) for p in PARTS}
        self.expert_kinds = ex["kinds"]
        self.expert_layer_kinds = {int(k): v for k, v in ex.get("layer_kinds", {}).items()}  # raw GGUF packs
        self.expert_nbytes = ex["nbytes"]           # on-disk bytes of one expert (unpadded; raw GGUF: the largest)
        self.expert_layers = {int(k): v for k, v in ex["layers"].items()}
        self._checks: dict = {}          # (layer, expert) -> expert_check's (crc ranges, crc32)
        self._heads: dict = {}           # layer -> expert_heads
        self.num_expert_total = sum(len(v) for v in self.expert_layers.values())

    def _check(self, size: int, data_sizes: list[int]):
        """What the header says agrees with itself and with the file (so no read or array is sized by a header
        field alone): the spec with the tensors and experts, and every byte range inside the file it lies in
        (data_sizes: the data files', where an index's experts are) and exactly as long as its shape needs."""
        bad = next(self._disagreements(size, data_sizes), None)
        if bad:
            raise WorkbenchError(f"{self.path}: the header does not agree with {bad} (corrupt pack; re-convert)")

    def _disagreements(self, size: int, data_sizes: list[int]):
        def inside(o, n, sizes=data_sizes):            # a range inside the data file its offset names
            return type(o) is int and 0 <= o >> SHARD_BITS < len(sizes) and _inside(o & SHARD_MASK, n,
                                                                                    sizes[o >> SHARD_BITS])
        s = self.spec
        if not isinstance(self.header["source"]["path"], str):
            yield "its source"
        ff, d = s.moe_intermediate_size, s.hidden_size
        if not 0 < s.num_layers <= len(self.tensors) or sorted(self.expert_layers) != s.moe_layers:
            yield "its layers"
        if any(len(v) != s.num_experts for v in self.expert_layers.values()):
            yield "its experts per layer"
        if self.expert_shapes != expert_shapes(d, ff):
            yield "its expert shapes"
        for name, t in self.tensors.items():
            where = data_sizes if t.get("in") == "data" else [size]
            runs = t.get("runs", [(t["offset"], t["nbytes"])])
            if not all(inside(o, n, where) for o, n in runs) or sum(n for _, n in runs) != t["nbytes"] \
                    or t["nbytes"] != _nbytes(tuple(t["shape"]), t["kind"]) or not isinstance(t["crc32"], str):
                yield f"tensor {name}"
        for L, ents in self.expert_layers.items():      # the experts lie in the data files
            kinds = self.kinds_of(L)
            want = {p: _nbytes(self.expert_shapes[p], kinds[p]) for p in PARTS}
            for e, ent in enumerate(ents):
                runs = _part_runs(ent)
                span = ent.get("span")
                if any(sum(n for _, n in runs[p]) != want[p] for p in PARTS) \
                        or any(not inside(o, n) or span and not span[0] <= o <= o + n <= span[0] + span[1]
                               for p in PARTS for o, n in runs[p]) \
                        or span and not inside(*span) or not isinstance(ent["crc32"], str):
                    yield f"expert {e} of layer {L}"

    def kinds_of(self, layer: int) -> dict[str, str]:
        """{part: kind} of one layer's experts (a raw GGUF pack keeps each layer's own block types)."""
        return self.expert_layer_kinds.get(layer, self.expert_kinds)

    @property
    def mean_expert_bytes(self) -> float:
        """What reading one expert takes from disk, the mean over the MoE layers (a GGUF's layers may hold different
        blocks): the one meaning of `expert_disk_bytes` in every record (bench's, simulate's)."""
        layers = self.spec.moe_layers
        return sum(sum(n for _, n in self.expert_reads(L, 0)) for L in layers) / len(layers)

    @property
    def total_expert_bytes(self) -> int:
        return self.header["experts"].get("total_nbytes", self.expert_nbytes * self.num_expert_total)

    def content_id(self) -> str:
        return hashlib.sha256(_header_bytes(self.header)).hexdigest()[:16]

    def tensor(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return _decode(self.tensor_bytes(name), tuple(t["shape"]), t["kind"])

    def tensor_bytes(self, name: str) -> np.ndarray:
        """Tensor `name` as the pack stores it (its kind's encoding), checked."""
        t = self.tensors[name]
        runs = t.get("runs", [(t["offset"], t["nbytes"])])
        if t.get("in") == "data":
            buf = np.concatenate([self.read(o, n) for o, n in runs]) if runs else np.empty(0, np.uint8)
        else:
            buf = np.fromfile(self.path, np.uint8, t["nbytes"], offset=t["offset"])
        if _crc(buf) != t["crc32"]:
            raise WorkbenchError(f"{self.path}: checksum mismatch in tensor {name} (corrupt pack)")
        return buf

    def read(self, offset: int, n: int) -> np.ndarray:
        """n bytes at an offset into the data files (at_shard), read buffered; a file that ends early is one line
        naming it. For the occasional read (a tensor, an expert for export): a Reader streams."""
        path = self.data_paths[offset >> SHARD_BITS]
        buf = np.fromfile(path, np.uint8, n, offset=offset & SHARD_MASK)
        if buf.size != n:
            raise WorkbenchError(f"{path}: truncated: {n} bytes at {offset & SHARD_MASK}, {buf.size} there")
        return buf

    def expert_bytes(self, layer: int, e: int) -> list[np.ndarray]:
        """The bytes of expert_reads(layer, e), in order, read buffered (decode_expert takes them)."""
        return [self.read(o, n) for o, n in self.expert_reads(layer, e)]

    def expert_reads(self, layer: int, e: int) -> list[tuple[int, int]]:
        """The (offset, length) reads that bring in one expert: one for contiguous, three for native."""
        ent = self.expert_layers[layer][e]
        if "span" in ent:
            return [tuple(ent["span"])]
        return [r for p in PARTS for r in _part_runs(ent)[p]]

    def expert_heads(self, layer: int) -> np.ndarray:
        """(experts, 3) int64: where each part of each expert of `layer` starts past the 4 KiB boundary at or before
        it (a slot read starts at that boundary). Zero in a pack, which aligns its parts; an index's GGUF aligns
        them to 32 bytes only."""
        heads = self._heads.get(layer)
        if heads is None:
            ents = self.expert_layers[layer]
            heads = self._heads[layer] = np.array(
                [[0] * 3 if "span" in ent else [o % ALIGN for o, _ in self.expert_reads(layer, e)]
                 for e, ent in enumerate(ents)], np.int64).reshape(len(ents), -1)
        return heads

    def expert_check(self, layer: int, e: int) -> tuple[list, int]:
        """(runs, crc32): expert e's bytes in the buffers of expert_reads(layer, e) are good when the crc32 over
        runs ((buffer, start, end) in order) is crc32. What a reader checks as a read lands in a slot. Adjacent
        parts are one run: one crc32 call for a contiguous expert. Worked out once per expert."""
        check = self._checks.get((layer, e))
        if check is None:
            ent = self.expert_layers[layer][e]
            if "span" in ent:
                runs, base = [], ent["span"][0]
                for o, n in (ent["parts"][p] for p in PARTS):
                    if runs and runs[-1][2] == o - base:
                        runs[-1][2] = o - base + n
                    else:
                        runs.append([0, o - base, o - base + n])
            else:
                runs = [[i, 0, n] for i, (_, n) in enumerate(self.expert_reads(layer, e))]
            check = self._checks[(layer, e)] = ([tuple(r) for r in runs], int(ent["crc32"], 16))
        return check

    def check_expert(self, layer: int, e: int, chunks) -> None:
        """Raise unless expert e's bytes (chunks: the buffers of expert_reads(layer, e), in order, each at least
        its read long) have the pack's crc32."""
        runs, want = self.expert_check(layer, e)
        if crc_of_runs(chunks, runs) != want:
            raise self.checksum_error(layer, e)

    def checksum_error(self, layer: int, e: int) -> WorkbenchError:
        return WorkbenchError(f"{self.path}: checksum mismatch in expert {e} of layer {layer} (corrupt pack)")

    def decode_expert(self, layer: int, e: int, chunks: list[np.ndarray], raw: bool = False) -> dict[str, np.ndarray]:
        """chunks: the bytes of expert_reads(layer, e), in order. Checks the crc, returns f32 matrices
        (raw=True: each part's encoded bytes, for an engine that computes from the packed format)."""
        self.check_expert(layer, e, chunks)
        ent = self.expert_layers[layer][e]
        if "span" in ent:
            base = ent["span"][0]
            parts = {p: chunks[0][o - base:o - base + n] for p, (o, n) in ent["parts"].items()}
        elif "runs" in ent:             # codes, scales, biases of each part, read apart: joined as the pack lays them
            it = iter(chunks)
            parts = {p: np.concatenate([np.asarray(next(it))[:n] for _, n in ent["runs"][p]]) for p in PARTS}
        else:
            parts = dict(zip(PARTS, chunks))
        if raw:
            return parts
        kinds = self.kinds_of(layer)
        return {p: _decode(parts[p], self.expert_shapes[p], kinds[p]) for p in PARTS}
