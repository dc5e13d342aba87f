"""A random-weight checkpoint of a real model's shape, written straight to a GGUF that stock llama.cpp runs.

    make_gguf("qwen3-next-80b-a3b", "next.gguf")                  # every layer and expert, --type q2_k_s
    make_gguf("qwen3.6-35b-a3b", "small.gguf", layers=4, experts=16, qtype="q4_k_m")

The architecture is the real one (workbench.shapes.hf_config: qwen3moe, qwen3next, qwen35moe), with the tensor
names, order and metadata of engines/gguf_export.py. Nothing is quantized: the weights are random, so each
quantized block is drawn as random bytes and then its scale fields are set (_SCALES) so that the dequantized values
have mean 0 and std 0.02, the std of the Hugging Face checkpoints make-model writes. The token embedding, the
routers, the first full-attention layer's projections (F16) and the output projections' rows into the routing's
dims are laid out so that the routing has a real model's statistics (workbench/made_routing.py). Data is generated
and written a slice of rows at a time after the header and tensor table, so memory stays flat whatever the size.
The random-weights card is the metadata key `workbench.random_weights` (workbench.shapes.random_label finds it).

--type mixes, after llama.cpp's llama_tensor_get_type: q4_k_m (experts Q4_K, ffn_down Q6_K on use_more_bits layers,
output Q6_K, the rest Q4_K); q2_k (experts Q2_K, ffn_down Q3_K); q2_k_s (experts Q2_K, ffn_down Q4_K in the first
eighth of the layers); q8_0. Norms, routers and DeltaNet's small tensors stay F32, as the exporter writes them.

Where the real model has multi-token prediction (Qwen3-Next, Qwen3.5/3.6-MoE: `mtp_num_hidden_layers` 1), its
block is written as llama.cpp's converter writes it, at every --layers: `{arch}.nextn_predict_layers` = 1,
`{arch}.block_count` = the main layers + 1, and block n_main a full-attention decoder block (gated attention, the
experts, the shared expert) plus `nextn.eh_proj` (the [embedding; hidden] -> hidden projection), `nextn.enorm`,
`nextn.hnorm` and `nextn.shared_head_norm` (norms 1); it shares the main model's embedding and output. Stock
llama.cpp loads it and leaves it out of the main pass; the workbench skips it (GGUFModel.mtp_layers).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from engines.gguf_export import _check, _gguf, _plan, gguf_vocab, write_metadata
from engines.gguf_export_hybrid import ARCH
from workbench import shapes
from workbench.atomic import atomic_path
from workbench.made_routing import Layout, _OUTPUTS
from workbench.errors import WorkbenchError
from workbench.shapes import DEMO, RANDOM_KEY, SHAPES, card, check_request, hf_config
from workbench.spec import from_hf_config

STD = 0.02
CHUNK = 32 << 20                   # bytes generated and written at a time


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# --type: (experts' gate and up, experts' down by (layer, layers), output, the other matrices, llama.cpp file type)
RECIPES = {
    "q4_k_m": ("Q4_K", lambda i, n: "Q6_K" if _more_bits(i, n) else "Q4_K", "Q6_K", "Q4_K", "MOSTLY_Q4_K_M"),
    "q2_k": ("Q2_K", lambda i, n: "Q3_K", "Q6_K", "Q4_K", "MOSTLY_Q2_K"),
    "q2_k_s": ("Q2_K", lambda i, n: "Q4_K" if i < n // 8 else "Q2_K", "Q6_K", "Q4_K", "MOSTLY_Q2_K_S"),
    "q8_0": ("Q8_0", lambda i, n: "Q8_0", "Q8_0", "Q8_0", "MOSTLY_Q8_0"),
}
DEFAULT_TYPE = {"qwen3-next-80b-a3b": "q2_k_s"}      # near the 27.6 GB file smolmaxxing ran; others q4_k_m


def _uniform_rms(n: int, offset: float) -> float:
    """The root mean square of q - offset for q uniform over 0 .. n-1."""
    return float(np.sqrt((n * n - 1) / 12 + ((n - 1) / 2 - offset) ** 2))


def _f16(x: float) -> np.ndarray:
    return np.array([x], np.float16).view(np.uint8)


def _q8_0(b):                      # d, int8[32]: d * q
    b[:, 0:2] = _f16(STD / _uniform_rms(256, 128))


def _q2_k(b):                      # scales[16] (sc | m << 4), qs[64], d, dmin: d * sc * q - dmin * m, q in 0..3
    b[:, 0:16] = 8 | 8 << 4
    d = STD / (8 * _uniform_rms(4, 1.5))
    b[:, 80:82], b[:, 82:84] = _f16(d), _f16(1.5 * d)        # dmin * m = d * sc * mean(q): mean 0


def _q3_k(b):                      # hmask[32], qs[64], scales[12] (6-bit, minus 32), d: d * (s - 32) * q, q in -4..3
    b[:, 108:110] = _f16(STD / (_uniform_rms(64, 32) * _uniform_rms(8, 4)))      # scales stay random


def _q4_k(b):                      # d, dmin, scales[12] (6-bit sc and m, packed), qs[128]: d * sc * q - dmin * m
    b[:, 4:12], b[:, 12:16] = 32 | 2 << 6, 0                  # sc = m = 32 for all eight sub-blocks
    d = STD / (32 * _uniform_rms(16, 7.5))
    b[:, 0:2], b[:, 2:4] = _f16(d), _f16(7.5 * d)


def _q5_k(b):                      # as Q4_K with a fifth bit, q in 0..31
    b[:, 4:12], b[:, 12:16] = 16 | 1 << 6, 0                  # sc = m = 16
    d = STD / (16 * _uniform_rms(32, 15.5))
    b[:, 0:2], b[:, 2:4] = _f16(d), _f16(15.5 * d)


def _q6_k(b):                      # ql[128], qh[64], scales int8[16], d: d * scale * (q - 32)
    b[:, 192:208] = np.where(b[:, 192:208] & 1, 8, -8).astype(np.int8).view(np.uint8)     # random signs: mean 0
    b[:, 208:210] = _f16(STD / (8 * _uniform_rms(64, 32)))


_SCALES = {"Q8_0": _q8_0, "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def random_blocks(rng, t: str, n_values: int) -> np.ndarray:
    """n_values of GGML type t as random blocks, (blocks, block bytes) uint8, dequantizing to mean 0, std STD."""
    gguf = _gguf()
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]]
    n = n_values // block * size
    b = rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n].reshape(-1, size)
    _SCALES[t](b)
    return b


_D = {"Q8_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}   # d, dmin


def _floats(rng, gname: str, rows: int, cols: int, layout: Layout | None = None, r: int = 0) -> np.ndarray:
    """(rows, cols) of an F32 / F16 tensor from row r: norms 1 (llama.cpp's norms multiply), DeltaNet's decay and
    step bias as Qwen3-Next initialises them, the rest normal with std STD; then the routing laid in (Layout)."""
    base = gname.rsplit(".", 1)[0] if gname.endswith((".weight", ".bias")) else gname
    if base.endswith("ssm_a"):                               # -exp(A_log), A uniform in (0, 16]
        return -rng.uniform(1.0, 16.0, (rows, cols)).astype(np.float32)
    if base.endswith("ssm_conv1d"):                         # PyTorch's Conv1d init: within 1/sqrt(fan-in 4)
        return rng.uniform(-0.5, 0.5, (rows, cols)).astype(np.float32)
    if base.endswith("norm") or base.endswith("ssm_dt"):
        a = np.ones((rows, cols), np.float32)
    else:
        a = rng.standard_normal((rows, cols), np.float32) * STD
    return layout.floats(rng, gname, r, a) if layout else a


class _Shapes:
    """What engines.gguf_export._plan asks of a model: spec, names and each canonical tensor's shape."""

    def __init__(self, spec, path: str):
        self.spec, self.path = spec, path

    def names(self):
        return ["lm_head"]

    def tensor_shape(self, name: str) -> tuple:
        s = self.spec
        d, h, kv, hd, sh = s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.shared_expert_size
        key = name.split(".", 2)[2] if name.startswith("layers.") else name
        return {"embed": (s.vocab_size, d), "lm_head": (s.vocab_size, d), "norm": (d,), "attn_norm": (d,),
                "mlp_norm": (d,), "q": ((2 if s.attn_output_gate else 1) * h * hd, d), "k": (kv * hd, d),
                "v": (kv * hd, d), "o": (d, h * hd), "q_norm": (hd,), "k_norm": (hd,), "router": (s.num_experts, d),
                "shared.gate": (sh, d), "shared.up": (sh, d), "shared.down": (d, sh), "shared_gate": (1, d)}[key]


def _type(recipe, gname: str, shape, t: str, n_layers: int, layout: Layout) -> str:
    gate_up, down, output, rest, _ = recipe
    if t == "F32":
        return t
    if layout.float_type(gname):             # the routing is laid out in them (Layout); 16 MB at the demo's vocab
        return "F16"
    if "_exps." in gname:
        t = down(int(gname.split(".")[1]), n_layers) if "ffn_down" in gname else gate_up
    else:
        t = output if gname == "output.weight" else rest
    gguf = _gguf()
    row = shape[-1]
    for want in (t, "Q8_0", "F16"):          # a row that does not split into the type's blocks takes the next
        if row % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[want]][0] == 0:
            return want


def plan(shape: str, layers: int | None = None, experts: int | None = None, qtype: str | None = None):
    """(spec, [(gguf name, numpy shape, GGML type)] in file order, llama.cpp file type name)."""
    qtype = qtype or DEFAULT_TYPE.get(shape, "q4_k_m")
    if qtype not in RECIPES:
        raise WorkbenchError(f"--type {qtype!r}: choose one of {', '.join(RECIPES)}")
    if layers is None:
        layers = SHAPES[shape]["num_hidden_layers"] if shape in SHAPES else 0
    experts = check_request(shape, layers, experts)
    cfg = hf_config(shape, layers, experts)
    interval = cfg.get("full_attention_interval")
    if interval and layers < interval:
        raise WorkbenchError(f"--layers {layers}: {shape} has full attention every {interval}th layer; a GGUF of it "
                             f"needs at least {interval} layers")
    spec = from_hf_config(cfg, shape)
    _check(spec, shape)
    recipe = RECIPES[qtype]
    layout = Layout(with_mtp(spec, cfg))
    rows = [(g, tuple(sh), _type(recipe, g, sh, t, layers, layout))
            for g, sh, t, _ in _plan(_Shapes(with_mtp(spec, cfg), shape), "f16")]
    return spec, _nextn(rows, spec, cfg, recipe, layout), recipe[4]


def with_mtp(spec, cfg: dict):
    """The spec with the MTP blocks as more layers (full attention), as llama.cpp's block_count counts them."""
    n = cfg.get("mtp_num_hidden_layers", 0)
    return replace(spec, num_layers=spec.num_layers + n, layer_types=spec.layer_types + ["full_attention"] * n) \
        if n else spec


def _nextn(rows, spec, cfg: dict, recipe, layout: Layout):
    """rows with each MTP block's own tensors after its decoder block's."""
    d, out = spec.hidden_size, []
    for row in rows:
        out.append(row)
        gname = row[0]
        last = gname.startswith("blk.") and gname.endswith(".ffn_gate_inp_shexp.weight")
        if last and (i := int(gname.split(".")[1])) >= spec.num_layers:
            eh = f"blk.{i}.nextn.eh_proj.weight"
            out += [(eh, (d, 2 * d), _type(recipe, eh, (d, 2 * d), "F16", spec.num_layers, layout)),
                    *((f"blk.{i}.nextn.{n}.weight", (d,), "F32") for n in ("enorm", "hnorm", "shared_head_norm"))]
    return out


def nbytes(shape, t: str) -> int:
    gguf = _gguf()
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]]
    return int(np.prod(shape)) // block * size


def file_bytes(rows) -> int:
    """The tensor data's size in the file (each tensor aligned); the header adds well under a MiB."""
    align = _gguf().GGUF_DEFAULT_ALIGNMENT
    return sum(-(-nbytes(sh, t) // align) * align for _, sh, t in rows)


def make_gguf(shape: str, out, layers: int | None = None, experts: int | None = None, qtype: str | None = None,
              seed: int = 0, progress: bool = False) -> Path:
    """Write the shape's random GGUF to `out` atomically; refused before anything is written when the disk lacks
    room."""
    gguf = _gguf()
    qtype = qtype or DEFAULT_TYPE.get(shape, "q4_k_m")
    spec, rows, ftype = plan(shape, layers, experts, qtype)
    cfg = hf_config(shape, spec.num_layers, spec.num_experts)
    out = Path(out)
    need, free = file_bytes(rows) + (1 << 20), shapes.free_bytes(out)
    if need > free:
        raise WorkbenchError(f"{out}: {shape} ({spec.num_layers} layers, {spec.num_experts} experts, {qtype}) needs "
                             f"{need / 1e9:.2f} GB, the disk has {free / 1e9:.2f} GB free")
    if progress:
        import sys
        print(f"{out}: {need / 1e9:.2f} GB ({qtype}), {free / 1e9:.2f} GB free", file=sys.stderr)
    tokens, types, merges = gguf_vocab((DEMO / "tokenizer.json").read_text(encoding="utf-8"), spec.vocab_size,
                                       str(DEMO / "tokenizer.json"))
    c = {**card(shape, spec.num_layers, spec.num_experts, gguf=qtype), "seed": seed, "type": qtype}
    rng, layout = np.random.Generator(np.random.SFC64(seed)), Layout(with_mtp(spec, cfg))
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), ARCH.get(spec.family, "qwen3moe"))
        try:
            write_metadata(w, with_mtp(spec, cfg), tokens, types, merges, f"{shape} random", gguf.LlamaFileType[ftype])
            if cfg.get("mtp_num_hidden_layers"):
                w.add_nextn_predict_layers(cfg["mtp_num_hidden_layers"])
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
            w.add_string(RANDOM_KEY, json.dumps(c))
            for gname, sh, t in rows:
                w.add_tensor_info(gname, sh, np.dtype(np.float32), nbytes(sh, t),
                                  raw_dtype=gguf.GGMLQuantizationType[t])
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            f = w.fout[0]
            items = rows
            if progress:
                from tqdm.auto import tqdm
                items = tqdm(rows, desc=f"writing {out.name}", unit="tensor")
            for gname, sh, t in items:
                w.write_padding(f, f.tell())
                _write_tensor(f, rng, gname, sh, t, layout)
                w.write_padding(f, nbytes(sh, t))
        finally:
            w.close()
    return out


def _write_tensor(f, rng, gname: str, shape, t: str, layout: Layout):
    n_rows, row = int(np.prod(shape[:-1])), shape[-1]
    step = max(1, CHUNK // max(1, nbytes((row,), t)))
    for r in range(0, n_rows, step):
        n = min(step, n_rows - r)
        if t not in _SCALES:
            a = _floats(rng, gname, n, row, layout, r)
            f.write(a.astype(np.float16 if t == "F16" else np.float32).data)
            continue
        b = random_blocks(rng, t, n * row)
        if gname.endswith(_OUTPUTS):           # the rows that write the routing's dims: their scales times the gain
            blocks, gain = b.reshape(n, -1, b.shape[1]), layout.gains(gname, np.arange(r, r + n) % shape[-2])
            rows = gain != 1
            for o in _D[t]:
                d = blocks[rows, :, o:o + 2].copy().view(np.float16) * gain[rows, None, None].astype(np.float16)
                blocks[rows, :, o:o + 2] = d.view(np.uint8)
        f.write(b.data)
