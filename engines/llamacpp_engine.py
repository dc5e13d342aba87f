"""llama.cpp as a peer engine: run a GGUF in stock llama.cpp (through llama-cpp-python's low-level API),
measure it from outside, and read its routing during real forwards.

    LlamaCpp(path).forward(ids)            logits (T, vocab) of a batch, every row an output
    LlamaCpp(path, capture=TRACE_NAMES)    + per-layer tensors copied out by the eval callback
    bench_gguf(path, tokens, prompt, mode) tok/s, prefill tok/s, peak RSS, file pages resident
                                           (in a fresh child process, page cache dropped for "cold")
    capture_trace(path, ids)               per-token, per-layer routing + router inputs -> rows for Parquet
    resolve_gguf(model, qtype)             a GGUF for `demo`, a model directory, a pack, or a .gguf path
    LlamaCppEngine                         the `llamacpp` engine behind engines.engine_class (the engine interface)

llama_cpp is imported lazily: the rest of the workbench runs without it.

Routing capture: llama.cpp names graph tensors `<name>-<layer>`. `ffn_moe_topk-N` is a strided view
(the first k columns of an argsort), so rows are read with the tensor's own strides (ne/nb from the
ggml_tensor header). The last layer computes only the rows that produce output, so every token of a
traced batch asks for logits.
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from engines.base import Engine, Hooks
from workbench.atomic import atomic_path
from workbench.host import peak_rss_bytes, rss_bytes, rss_parts
from workbench.io import drop_page_cache
from workbench.errors import WorkbenchError

TRACE_NAMES = ("ffn_moe_topk", "ffn_moe_logits", "ffn_inp", "attn_residual")
# the residual stream entering the MoE block: ffn_inp-N, or attn_residual-N in the hybrid graphs (qwen3next, qwen35moe)
ROUTER_INPUT = ("ffn_inp", "attn_residual")
KQUANTS = {"q4_k_m": "Q4_K_M", "q4_k_s": "Q4_K_S", "q3_k_m": "Q3_K_M", "q3_k_s": "Q3_K_S", "q2_k": "Q2_K",
           "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "q4_0": "Q4_0"}
GGUF_TYPES = ("f16", "q8_0") + tuple(KQUANTS)
_GGML_F32, _GGML_I32 = 0, 26


def llama_cpp():
    try:
        import llama_cpp as lc
    except ImportError as e:
        raise WorkbenchError(f"the llamacpp engine needs llama-cpp-python ({e}): pip install -e '.[llamacpp]'") from None
    return lc


_STATE = {}


def _init():
    """Backend init and a silent log callback, once per process."""
    if _STATE:
        return _STATE
    lc = llama_cpp()
    quiet = lc.llama_log_callback(lambda level, text, user: None)
    if not os.environ.get("WORKBENCH_LLAMA_LOG"):
        lc.llama_log_set(quiet, ctypes.c_void_p(0))
    lc.llama_backend_init()
    from llama_cpp._ggml import libggml
    libggml.ggml_get_name.argtypes = [ctypes.c_void_p]
    libggml.ggml_get_name.restype = ctypes.c_char_p
    libggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
    libggml.ggml_nbytes.restype = ctypes.c_size_t
    libggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    libggml.ggml_backend_tensor_get.restype = None
    _STATE.update(lc=lc, quiet=quiet, ggml=libggml)
    return _STATE


class _TensorHead(ctypes.Structure):
    """The first fields of struct ggml_tensor (ggml.h): type, buffer, ne[4], nb[4]."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4)]


class LlamaCpp:
    """One GGUF loaded in llama.cpp (mmap on, CPU), one context, one sequence."""

    def __init__(self, path, n_ctx: int = 1024, n_batch: int = 512, threads: int = 1, capture=(),
                 mmap_on: bool = True, context: dict | None = None, gpu_layers: int = 0):
        """context: llama_context_params fields to set, e.g. {"flash_attn_type": 0, "type_k": 0, "type_v": 0}
        (flash attention off, an f32 KV cache; ggml type ids). gpu_layers: layers offloaded to the GPU (Metal on
        a Mac: gpu_layers_here()); 0, the CPU, everywhere else."""
        st = _init()
        lc = self.lc = st["lc"]
        self.path = Path(path)
        if not self.path.is_file():
            raise WorkbenchError(f"{self.path}: no such GGUF file")
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = gpu_layers
        # No extra CPU buffer types (weights repacked for AMX, KleidiAI or interleaved-repack kernels): plain ggml
        # CPU kernels only. ggml's AMX k-quant matmul, as GCC 12 compiles it under -march=native, faults on any
        # batch of 2+ tokens on Intel CPUs with AMX; the plain kernels run everywhere.
        mp.use_extra_bufts = False
        if hasattr(mp, "load_mode"):
            mp.load_mode = lc.LLAMA_LOAD_MODE_MMAP if mmap_on else lc.LLAMA_LOAD_MODE_NONE
        elif hasattr(mp, "use_mmap"):
            mp.use_mmap = mmap_on
        t0 = time.perf_counter()
        self.model = lc.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self.model:
            raise WorkbenchError(f"{self.path}: llama.cpp could not load this GGUF (set WORKBENCH_LLAMA_LOG=1 for its log)")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = False
        for k, v in (context or {}).items():
            setattr(cp, k, v)
        self.capture = tuple(capture)
        self.captured: dict[str, list[np.ndarray]] = {}
        if self.capture:
            self._cb = lc.ggml_backend_sched_eval_callback(self._eval)
            cp.cb_eval = self._cb
            cp.cb_eval_user_data = None
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise WorkbenchError(f"{self.path}: llama.cpp could not create a context (n_ctx={n_ctx})")
        self.load_s = time.perf_counter() - t0
        self.n_ctx, self.n_batch, self.threads = n_ctx, n_batch, threads
        self.pos = 0

    # ------------------------------------------------------------ routing capture

    def _eval(self, t, ask, user_data):
        g = _STATE["ggml"]
        name = g.ggml_get_name(t).decode("utf-8", "replace")
        base, _, layer = name.rpartition("-")
        if ask:
            return base in self.capture and layer.isdigit()
        if base not in self.capture or not layer.isdigit():
            return True
        h = ctypes.cast(t, ctypes.POINTER(_TensorHead)).contents
        dtype = {_GGML_F32: np.float32, _GGML_I32: np.int32}.get(h.type)
        if dtype is None:
            return True
        n = g.ggml_nbytes(t)
        buf = np.empty(n, np.uint8)
        g.ggml_backend_tensor_get(t, buf.ctypes.data, 0, n)
        ne0, ne1 = int(h.ne[0]), int(h.ne[1]) * int(h.ne[2]) * int(h.ne[3])
        nb0, nb1 = int(h.nb[0]), int(h.nb[1])
        a = np.lib.stride_tricks.as_strided(buf.view(np.uint8), shape=(ne1, ne0 * nb0), strides=(nb1, 1))
        self.captured.setdefault(name, []).append(np.ascontiguousarray(a).view(dtype).reshape(ne1, ne0))
        return True

    def take_captured(self) -> dict[str, np.ndarray]:
        out = {k: np.concatenate(v) for k, v in self.captured.items()}
        self.captured = {}
        return out

    # ------------------------------------------------------------ tokens

    def tokenize(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        n = len(data) + 8
        arr = (self.lc.llama_token * n)()
        k = self.lc.llama_tokenize(self.vocab, data, len(data), arr, n, False, False)
        if k < 0:
            raise WorkbenchError(f"llama.cpp tokenizer: {-k} tokens do not fit")
        return list(arr[:k])

    def detokenize(self, ids) -> str:
        out = b""
        buf = ctypes.create_string_buffer(256)
        for i in ids:
            n = self.lc.llama_token_to_piece(self.vocab, int(i), buf, 256, 0, False)
            out += buf.raw[:max(0, n)]
        return out.decode("utf-8", "replace")

    # ------------------------------------------------------------ forward

    def reset(self):
        mem = self.lc.llama_get_memory(self.ctx)
        self.lc.llama_memory_clear(mem, True)
        self.pos = 0

    def truncate(self, pos: int):
        mem = self.lc.llama_get_memory(self.ctx)
        self.lc.llama_memory_seq_rm(mem, 0, pos, -1)
        self.pos = pos

    def forward(self, ids, all_logits: bool = True) -> np.ndarray:
        """Decode `ids` at the current position; logits (T, vocab), or (1, vocab) of the last token."""
        ids = [int(i) for i in ids]
        if self.pos + len(ids) > self.n_ctx:
            raise WorkbenchError(f"context of {self.pos + len(ids)} tokens exceeds llama.cpp's n_ctx {self.n_ctx}")
        lc, outs = self.lc, []
        for s in range(0, len(ids), self.n_batch):
            chunk = ids[s:s + self.n_batch]
            last = s + len(chunk) == len(ids)
            batch = lc.llama_batch_init(len(chunk), 0, 1)
            try:
                for j, tok in enumerate(chunk):
                    batch.token[j] = tok
                    batch.pos[j] = self.pos + j
                    batch.n_seq_id[j] = 1
                    batch.seq_id[j][0] = 0
                    batch.logits[j] = all_logits or (last and j == len(chunk) - 1)
                batch.n_tokens = len(chunk)
                rc = lc.llama_decode(self.ctx, batch)
                if rc != 0:
                    raise WorkbenchError(f"llama_decode failed with code {rc}")
                n_out = len(chunk) if all_logits else int(last)
                if n_out:
                    ptr = lc.llama_get_logits(self.ctx)
                    outs.append(np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab)).copy())
            finally:
                lc.llama_batch_free(batch)
            self.pos += len(chunk)
        return np.concatenate(outs) if outs else np.zeros((0, self.n_vocab), np.float32)

    def generate(self, ids, tokens: int) -> dict:
        """Greedy decoding; the time split of prefill and each decode step."""
        self.reset()
        t0 = time.perf_counter()
        logits = self.forward(ids, all_logits=False)
        prefill_s = time.perf_counter() - t0
        out, steps = [], []
        for i in range(tokens):
            nxt = int(np.argmax(logits[-1]))
            out.append(nxt)
            if i == tokens - 1:
                break
            t0 = time.perf_counter()
            logits = self.forward([nxt], all_logits=False)
            steps.append(time.perf_counter() - t0)
        return {"tokens": out, "prefill_s": prefill_s, "step_s": steps}

    def close(self):
        if getattr(self, "ctx", None):
            self.lc.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.lc.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


# ---------------------------------------------------------------- GGUF files for models

def quantize_gguf(src, dst, qtype: str, threads: int = 1) -> Path:
    """llama.cpp's own quantizer (llama_model_quantize): an f16 GGUF -> Q4_K_M etc., atomically."""
    lc = _init()["lc"]
    if qtype not in KQUANTS:
        raise WorkbenchError(f"--type {qtype!r}: choose one of {', '.join(GGUF_TYPES)}")
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{KQUANTS[qtype]}")
    params.nthread = threads
    with atomic_path(dst) as tmp:
        rc = lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise WorkbenchError(f"{src}: llama_model_quantize to {qtype} failed ({rc})")
    return Path(dst)


def resolve_gguf(model: str, qtype: str = "f16", progress: bool = False) -> Path:
    """A GGUF for `model`: a .gguf path as it is; `demo`, a model directory or a pack exported once
    (cached under $WORKBENCH_CACHE/gguf, keyed by the source's fingerprint and the type)."""
    from engines.gguf_export import export_gguf
    from workbench.registry import cache_dir, fingerprint, is_pack, model_dir
    if str(model).endswith(".gguf"):
        p = Path(model)
        if not p.is_file():
            raise WorkbenchError(f"{p}: no such GGUF file")
        return p
    if qtype not in GGUF_TYPES:
        raise WorkbenchError(f"--type {qtype!r}: choose one of {', '.join(GGUF_TYPES)}")
    src = model_dir(model)
    dst = cache_dir() / "gguf" / f"{src.name}-{fingerprint(src)}-{qtype}.gguf"
    if dst.exists():
        return dst
    if qtype in KQUANTS:
        f16 = resolve_gguf(model, "f16", progress)
        return quantize_gguf(f16, dst, qtype)
    if is_pack(src):
        from workbench.store.pack import Pack
        source = Pack(src)
    else:
        from workbench.models.hf import HFModel
        source = HFModel(src)
    return export_gguf(source, dst, qtype, progress=progress)


# ---------------------------------------------------------------- measuring from outside

def read_whole_file(path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass


_libc = None


def _lib():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        _libc.mmap.restype = ctypes.c_void_p
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        _libc.mincore.restype = ctypes.c_int
    return _libc


def resident_bytes(path) -> tuple[int, int]:
    """(bytes of the file in the page cache, file size): mincore on a fresh read-only mapping of it.
    For a file mapping mincore reports the page cache, so this counts pages any process brought in."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    libc, page = _lib(), mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            pages = int((np.frombuffer(vec, np.uint8) & 1).sum())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size, pages * page), size


ALL_LAYERS = 999     # n_gpu_layers past any model's layer count: every layer on the GPU


def gpu_layers_here() -> int:
    """The peer's GPU layers: every layer where llama-cpp-python was built with a GPU backend on Apple silicon
    (its Metal build, what a Mac user runs), else 0 (the CPU, as the workbench computes)."""
    from workbench.host import apple_silicon
    return ALL_LAYERS if apple_silicon() and _init()["lc"].llama_supports_gpu_offload() else 0


def mapping_rss(path) -> int | None:
    """Bytes of `path`'s mappings resident in this process (/proc/self/smaps); None where there is no /proc."""
    target, total, inside = str(Path(path).resolve()), 0, False
    try:
        f = open("/proc/self/smaps")
    except OSError:
        return None
    with f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                inside = len(parts) >= 6 and parts[5] == target
            elif inside and parts and parts[0] == "Rss:":
                total += int(parts[1]) * 1024
    return total


def _bench_child(path: str, tokens: int, prompt: str, mode: str, threads: int, warmup: int) -> dict:
    """Runs in a fresh process: load, prefill, greedy decode; what the OS saw."""
    dropped = None
    if mode == "cold":
        dropped = drop_page_cache(path)
    elif mode == "warm":
        read_whole_file(path)
    resident_before, size = resident_bytes(path)
    gpu_layers = gpu_layers_here()
    llm = LlamaCpp(path, n_ctx=max(256, 2 * tokens + 64 + len(prompt)), threads=threads, gpu_layers=gpu_layers)
    ids = llm.tokenize(prompt)
    if not ids:
        raise WorkbenchError("empty prompt")
    if warmup and mode == "warm":       # code paths only; cold runs measure the first touch of the file
        llm.generate(ids, warmup)
    res = llm.generate(ids, tokens)
    dec = sum(res["step_s"])
    st = rss_parts()
    resident_after, _ = resident_bytes(path)
    out = {"engine": "llamacpp", "gguf": str(path), "mode": mode, "page_cache_dropped": dropped, "threads": threads,
           "mmap": True, "n_gpu_layers": gpu_layers,
           "tokens": len(res["tokens"]), "decode_steps": len(res["step_s"]),
           "tok_s": len(res["step_s"]) / dec if dec > 0 else 0.0,
           "prefill_tokens": len(ids), "prefill_tok_s": len(ids) / res["prefill_s"] if res["prefill_s"] > 0 else 0.0,
           "prefill_s": res["prefill_s"], "decode_s": dec, "load_s": llm.load_s,
           "peak_rss_bytes": peak_rss_bytes(), "rss_bytes": st.get("VmRSS", rss_bytes()), "rss_anon_bytes": st.get("RssAnon"), "rss_file_bytes": st.get("RssFile"),
           "gguf_mapped_rss_bytes": mapping_rss(path), "file_size": size,
           "file_resident_before_bytes": resident_before, "file_resident_after_bytes": resident_after,
           "text": llm.detokenize(res["tokens"]), "token_ids": res["tokens"]}
    llm.close()
    return out


def bench_gguf(path, tokens: int = 64, prompt: str = "Once upon a time", mode: str = "cold", threads: int = 1,
               warmup: int = 4, timeout: float = 1800) -> dict:
    """Measure stock llama.cpp on `path` in a fresh child process (so peak RSS is its own)."""
    if mode not in ("cold", "warm", "as_is"):
        raise WorkbenchError(f"mode {mode!r}: choose cold, warm or as_is")
    cmd = [sys.executable, "-m", "engines.llamacpp_engine", "_bench", json.dumps(
        {"path": str(path), "tokens": tokens, "prompt": prompt, "mode": mode, "threads": threads, "warmup": warmup})]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise WorkbenchError(f"llama.cpp bench of {path} failed: {tail[0]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- routing traces

def capture_trace(path, ids: list[int], n_batch: int = 256, threads: int = 1) -> dict:
    """Run `ids` through llama.cpp (teacher-forced, every row an output) and read each layer's routing.

    Returns {"topk": (T, L, k) int, "logits": (T, L, E) f32, "router_input": (T, L, d) f32 (ffn_inp: the
    residual stream entering the MoE block), "moe_layers": [...], "final_logits": (T, vocab)}."""
    with LlamaCpp(path, n_ctx=max(64, len(ids) + 8), n_batch=n_batch, threads=threads, capture=TRACE_NAMES) as llm:
        llm.reset()
        final = llm.forward(ids, all_logits=True)
        got = llm.take_captured()
    layers = sorted({int(k.rpartition("-")[2]) for k in got if k.startswith("ffn_moe_topk-")})
    T = len(ids)
    base_in = next((b for b in ROUTER_INPUT if f"{b}-{layers[0]}" in got), ROUTER_INPUT[0]) if layers else None
    for L in layers:
        for base in ("ffn_moe_topk", "ffn_moe_logits", base_in):
            a = got.get(f"{base}-{L}")
            if a is None or a.shape[0] != T:
                raise WorkbenchError(f"{path}: captured {base}-{L} has {None if a is None else a.shape[0]} rows, "
                                     f"expected {T} (one per token)")
    return {"topk": np.stack([got[f"ffn_moe_topk-{L}"] for L in layers], 1),
            "logits": np.stack([got[f"ffn_moe_logits-{L}"] for L in layers], 1),
            "router_input": np.stack([got[f"{base_in}-{L}"] for L in layers], 1),
            "moe_layers": layers, "final_logits": final}


# ---------------------------------------------------------------- the engine interface (engines.engine_class)

def source_gguf(pack) -> Path | None:
    """The GGUF whose blocks a raw pack keeps, if it is still there unchanged: llama.cpp runs that file itself."""
    from workbench.models.gguf_model import GGUFModel
    src = pack.header.get("source", {})
    if src.get("format") != "gguf" or pack.quant != {"experts": "raw", "rest": "raw"} or not Path(src["path"]).is_file():
        return None
    return Path(src["path"]) if GGUFModel(src["path"]).source_info() == src else None


class LlamaCppEngine(Engine):
    """The engine interface on llama.cpp: a raw GGUF pack's source file (source_gguf), else the pack exported
    once to an f16 GGUF (its dequantized weights), run by llama.cpp with mmap. llama.cpp routes exactly and
    manages its own memory: it takes no hooks, and the workbench's expert cache is not used (so no per-layer
    events)."""

    name = "llamacpp"
    takes_hooks = False

    @classmethod
    def needed_weights(cls, pack) -> dict:
        """The routers and norms only (what routing observers read): llama.cpp holds the rest in its GGUF."""
        return {n: pack.tensor(n) for n in pack.tensors if n.endswith(("router", "norm", "router_bias"))}

    def __init__(self, pack, streamer, telemetry, hooks: Hooks = Hooks(), weights: dict | None = None,
                 threads: int = 1, max_context: int | None = None):
        from engines.gguf_export import PackModel, export_gguf
        from workbench.registry import cache_dir, fingerprint
        super().__init__(pack, streamer, telemetry, hooks)
        path = source_gguf(pack) or cache_dir() / "gguf" / f"{Path(pack.path).name}-{fingerprint(pack.path)}-f16.gguf"
        if not path.exists():
            export_gguf(PackModel(pack), path, "f16")
        self.gguf = path
        self.w = weights if weights is not None else self.needed_weights(pack)
        self.max_context = max_context or self.spec.max_position_embeddings
        self.llm = LlamaCpp(path, n_ctx=self.max_context, threads=threads)

    def reset(self):
        self.llm.reset()

    @property
    def pos(self):
        return self.llm.pos

    def truncate(self, pos: int):
        self.llm.truncate(pos)

    def forward(self, ids, phase: str) -> np.ndarray:
        t0 = time.perf_counter()
        logits = self.llm.forward(ids, all_logits=True)
        self.dense_compute_s += time.perf_counter() - t0      # all of llama.cpp's time counts as compute
        return logits


def _main(argv):
    if len(argv) >= 2 and argv[0] == "_bench":
        a = json.loads(argv[1])
        try:
            print(json.dumps(_bench_child(a["path"], a["tokens"], a["prompt"], a["mode"], a["threads"], a["warmup"])))
        except WorkbenchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    print("usage: python -m engines.llamacpp_engine _bench JSON  (internal; use python -m workbench bench --engine llamacpp)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
