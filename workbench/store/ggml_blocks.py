"""ggml's block formats for a checkpoint's experts: `--experts g2|g3|g4|g8` writes each expert matrix in one of
llama.cpp's own block types (pack kinds "gguf:<TYPE>", the kinds a GGUF's raw blocks already have), quantized from
float32 by ggml's own quantizer, so the packed engine computes them in ggml's CPU kernels (engines/ggml_kernels.py)
and the numpy engine dequantizes them (the gguf package), as for a GGUF imported with `--experts raw`.

    g4  Q4_K where a row is a multiple of 256 values (a k-quant superblock), else Q4_0 (blocks of 32)
    g3  Q3_K, else Q4_0 (ggml has no 3-bit type in blocks of 32)
    g2  Q2_K, else Q4_0
    g8  Q8_0

The affine group-64 kinds (q2, q3, q4, q8: MLX's layout, workbench/store/quant.py) stay what they were; these are
new names, so a pack's cache name never means two formats. Needs llama-cpp-python and gguf (the llamacpp extra):
ggml's libraries come with the first, block sizes with the second.
"""
from __future__ import annotations

import ctypes
import glob
from functools import lru_cache
from pathlib import Path

import numpy as np

from workbench.errors import WorkbenchError

BLOCKS = {"g2": ("Q2_K", "Q4_0"), "g3": ("Q3_K", "Q4_0"), "g4": ("Q4_K", "Q4_0"), "g8": ("Q8_0", "Q8_0")}
SUPER, SMALL = 256, 32          # values per k-quant superblock, per 32-block


def block_kind(experts: str, cols: int) -> str:
    """The pack kind of a matrix whose rows hold `cols` values at precision `experts` (g2, g3, g4, g8)."""
    big, small = BLOCKS[experts]
    if cols % SUPER == 0:
        return f"gguf:{big}"
    if cols % SMALL == 0:
        return f"gguf:{small}"
    raise WorkbenchError(f"--experts {experts}: rows of {cols} values do not split into ggml's blocks of {SMALL}; "
                         f"convert with --experts q{experts[1:]} or bf16")


def available() -> bool:
    """Whether ggml's quantizer and kernels are here (llama-cpp-python and gguf installed)."""
    try:
        import gguf  # noqa: F401
        library("ggml-base")
        return True
    except (ImportError, WorkbenchError):
        return False


def library(name: str) -> str:
    """The path of one of llama-cpp-python's ggml libraries ("ggml-base", "ggml-cpu")."""
    try:
        import llama_cpp
    except ImportError:
        raise WorkbenchError("experts kept in GGUF blocks are computed by ggml's CPU kernels, from "
                             "llama-cpp-python: pip install 'moe-workbench[llamacpp]'") from None
    lib = Path(llama_cpp.__file__).parent / "lib"
    found = [f for ext in ("so", "dylib", "dll") for f in glob.glob(str(lib / f"*{name}.{ext}"))]
    if not found:
        raise WorkbenchError(f"{lib}: no {name} library in llama-cpp-python")
    return found[0]


@lru_cache(maxsize=1)
def _quantize_chunk():
    f = ctypes.CDLL(library("ggml-base"), mode=ctypes.RTLD_GLOBAL).ggml_quantize_chunk
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    return f


def type_id(kind: str) -> int:
    """ggml's type number of a pack kind "gguf:<TYPE>" (the gguf package's enum is ggml's)."""
    from gguf import GGMLQuantizationType
    return int(GGMLQuantizationType[kind.removeprefix("gguf:")])


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """A float32 matrix in GGUF blocks, by ggml's own quantizer (no importance matrix): (rows, row bytes) uint8."""
    from gguf import GGML_QUANT_SIZES
    t = type_id(kind)
    w = np.ascontiguousarray(w, np.float32)
    block, size = GGML_QUANT_SIZES[t]
    if w.ndim != 2 or w.shape[1] % block:       # checked here: ggml aborts the process on a row that does not split
        raise WorkbenchError(f"{kind}: a matrix of shape {w.shape} does not split into rows of its blocks of {block}")
    out = np.zeros((w.shape[0], w.shape[1] // block * size), np.uint8)
    if _quantize_chunk()(t, w.ctypes.data, out.ctypes.data, 0, w.shape[0], w.shape[1], None) != out.nbytes:
        raise WorkbenchError(f"{kind}: ggml's quantizer wrote other than {out.nbytes} bytes")
    return out
