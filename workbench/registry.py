"""Where models live: registered names, Hugging Face directories, packs, and the pack cache.

`--model demo` is the demo model shipped in data/models/demo-moe. A Hugging Face directory is
converted to a pack on first use (per layout and precision) under $WORKBENCH_CACHE/packs
(default ~/.cache/moe-workbench); a pack path is used as it is.

A GGUF streams from where it lies: its own storage is its blocks in its layout (native, raw, raw), and at that
storage the cache holds only its index (workbench/store/gguf_index.py, a few MB), made on first use. A run on a
GGUF takes its own storage whatever its preset says, but for the knobs the run names itself (Session's layout=,
experts=, rest=); any other storage (requantized, mixed, laid out contiguous) is a converted pack, as for a model
directory.

A directory in MLX's layout (mlx-lm's convert: workbench/models/mlx_layout.py) is the same: its own storage is
its affine codes where they lie, and the cache holds only its index (workbench/store/safetensors_index.py). A
Hugging Face directory (one safetensors file or several shards) streams as it lies too, at its own precision (bf16,
f16, f32), where the run keeps it: the teacher on a bf16 or f16 checkpoint (keeps_precision), or a run that names
experts=raw (`--set experts=raw`: the checkpoint's own bytes); any other precision is a converted pack.

The preset's precision (q2, q3, q4, q8) names the bits; what an HF directory's experts are written as depends on
the engine (storage_for): for the packed engine (the default) they are ggml's blocks at those bits (g2, g3, g4, g8,
workbench/store/ggml_blocks.py: ggml's kernels compute them, results/kernels.md), where llama-cpp-python is
installed; for the numpy, MLX and llama.cpp engines, and where a run names experts= itself, the affine group-64
formats (MLX's layout, workbench/store/quant.py).
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.models.mlx_layout import is_mlx_layout
from workbench.store import ggml_blocks
from workbench.store.pack import FORMAT, MAGIC, Pack, convert, open_model, planned_size

REPO = Path(__file__).resolve().parents[1]
MODELS = {"demo": REPO / "data" / "models" / "demo-moe",
          "demo-draft": REPO / "data" / "models" / "demo-draft"}     # the demo's draft model (runtime.speculative)
ANNOUNCE_BYTES = 2**30       # a pack this large is said (size, place) before it is written: minutes, not seconds
GGUF_STORAGE = ("native", "raw", "raw")     # a GGUF's (or MLX layout's) own blocks where they lie: its index, no pack


def cache_dir() -> Path:
    return Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "moe-workbench"))


def is_pack(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(8) == MAGIC


def model_dir(model: str) -> Path:
    p = MODELS.get(model, Path(model))
    if not p.exists():
        known = ", ".join(MODELS)
        raise WorkbenchError(f"{p}: no such model (a registered name: {known}; a Hugging Face directory; or a pack)")
    return p


def fingerprint(path) -> str:
    """A short id of a model directory or file (each file's full path, size and mtime), for cache file names:
    two models never share a pack or an exported GGUF, and a changed model converts afresh."""
    p = Path(path)
    h = hashlib.sha256()
    for f in ([p] if p.is_file() else sorted(p.glob("*"))):   # a .gguf or a pack is its own fingerprint
        if p.is_file() or f.suffix in (".json", ".safetensors", ".gguf"):
            st = f.stat()
            h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def resolve_pack(model: str, layout: str, experts: str, rest: str, progress: bool = False) -> Path:
    """A pack for this model and storage setting, converting (once) if needed."""
    p = model_dir(model)
    if is_pack(p):
        return p
    if p.is_file() and p.suffix != ".gguf":       # a GGUF converts like a model directory
        raise WorkbenchError(f"{p}: not an expert pack (bad magic) and not a model directory")
    if (layout, experts, rest) == GGUF_STORAGE:     # the checkpoint's own bytes where they lie: an index
        dst = cache_dir() / "packs" / f"{p.name}-{fingerprint(p)}-f{FORMAT}.index"
        if not dst.exists():
            if p.suffix == ".gguf":
                from workbench.store.gguf_index import build_index
            else:
                from workbench.store.safetensors_index import build_index
            build_index(p, dst, progress=progress)
        return dst
    dst = pack_path(p, layout, experts, rest)
    if not dst.exists():
        model = open_model(p)
        size = planned_size(model, layout, experts, rest)
        what = f"a pack of {p} at layout {layout}, experts {experts}, rest {rest} ({size / 2**30:.2f} GiB) in {dst.parent}"
        if os.environ.get("WORKBENCH_NO_CONVERT"):
            raise WorkbenchError(f"--no-convert: this run needs {what}; run without --no-convert to write it, or at "
                                 f"the checkpoint's own storage (--set experts=raw: nothing written but an index)")
        if size >= ANNOUNCE_BYTES:
            print(f"writing {what} (once)", file=sys.stderr)
        convert(model, dst, layout=layout, experts=experts, rest=rest, progress=progress)
    return dst


def pack_path(p: Path, layout: str, experts: str, rest: str) -> Path:
    """Where the pack of model directory (or GGUF) p at this storage lies, written or not."""
    return cache_dir() / "packs" / f"{p.name}-{fingerprint(p)}-{layout}-{experts}-{rest}-f{FORMAT}.pack"  # a new format converts afresh


def needs_writing(model: str, layout: str, experts: str, rest: str) -> bool:
    """Whether resolve_pack would write a pack (a conversion, minutes), not find one or index the file in place."""
    p = model_dir(model)
    return not (is_pack(p) or (layout, experts, rest) == GGUF_STORAGE or pack_path(p, layout, experts, rest).exists())


def storage_for(model: str, storage, named=(), engine: str | None = None) -> tuple[str, str, str]:
    """(layout, experts, rest) a run on `model` with `engine` (None: the default, packed) takes: its preset's
    (storage, a Storage), but the checkpoint's own (GGUF_STORAGE) for each of the three knobs the run does not name
    itself (`named`) on a .gguf, an MLX-layout directory, a directory at experts=raw, or a preset that keeps a bf16
    directory's precision (keeps_precision); elsewhere, for the packed engine, an affine precision the run does not
    name becomes ggml's blocks at its bits (block_experts)."""
    knobs = dict(zip(("layout", "experts", "rest"), (storage.layout.value, storage.experts, storage.rest)))
    p = MODELS.get(model, Path(model))
    if str(model).endswith(".gguf") or is_mlx_layout(p) or (knobs["experts"] == "raw" and p.is_dir()) \
            or ("experts" not in named and keeps_precision(p, knobs)):
        return tuple(knobs[k] if k in named else own for k, own in zip(knobs, GGUF_STORAGE))
    if "experts" not in named and not is_pack(MODELS.get(model, Path(model))):     # a pack is what it is
        knobs["experts"] = experts_for(knobs["experts"], engine)
    return tuple(knobs.values())


def keeps_precision(p: Path, knobs: dict) -> bool:
    """Whether a run at these storage knobs on the Hugging Face directory p keeps its own precision, so it streams
    from its files as they lie: experts and rest at bf16 (the teacher's) on a checkpoint that holds every matrix at
    one 16-bit float precision, bf16 or f16 (make-model's: bf16 would round it, and copy it)."""
    if not (knobs["experts"] == knobs["rest"] == "bf16" and p.is_dir() and (p / "config.json").is_file()):
        return False
    from workbench.models.hf import HFModel
    from workbench.store.safetensors_index import in_place
    model = HFModel(p)
    kinds = {model.tensor_kind(n) for n in model.names() if len(model.tensor_shape(n)) == 2} \
        | set(model.expert_kinds(model.spec.moe_layers[0]).values())
    return in_place(model) and kinds in ({"bf16"}, {"f16"})


def experts_for(experts: str, engine: str | None) -> str:
    """The expert format a preset's precision is written in for `engine` (None: the default, packed): ggml's
    blocks at its bits for the packed engine (block_experts), `experts` as it is for the others."""
    return block_experts(experts) if engine in (None, "packed") else experts


def block_experts(experts: str) -> str:
    """The packed engine's expert format at a precision: ggml's blocks (g2..g8) for q2..q8 where ggml is installed
    (its kernels are faster than the affine ones: results/kernels.md), else `experts` as it is."""
    g = "g" + experts[1:]
    return g if g in ggml_blocks.BLOCKS and experts.startswith("q") and ggml_blocks.available() else experts


def tokenizer_for(pack: Pack):
    """The tokenizer: embedded in the pack's header, else tokenizer.json beside the source."""
    from tokenizers import Tokenizer

    text = pack.header.get("tokenizer")
    src = Path(pack.header["source"]["path"]) / "tokenizer.json"
    try:
        if text:
            return Tokenizer.from_str(text)
        if src.exists():
            return Tokenizer.from_file(str(src))
    except Exception as e:  # tokenizers raises plain Exception on a malformed or inconsistent tokenizer.json
        where = f"{pack.path}: the tokenizer in the pack header" if text else f"{src}"
        raise WorkbenchError(f"{where} is not a valid tokenizer ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return None
