"""The numpy engine's logits for every tiny family (and its YaRN variant) and every preset, on a fixed
prompt: prefill, then greedy decode steps. `tests/test_logits_fixture.py` checks them bit for bit against
`tests/fixtures/logits.npz`, written before a refactor by

    PYTHONPATH=$PWD python tests/logits_fixture.py        # rewrites tests/fixtures/logits.npz

The fixture keeps a sha256 of every logit (bit-identity) and the last decode row (to say how far off a
failure is), and the machine it was recorded on (`machine()`): BLAS and numpy pick their SIMD kernels by CPU, so
the same code gives other bits on another CPU (the demo's teacher differed by 1.9e-6 between an AVX-512 and an AVX2
machine). The demo model is in it for the edge0 preset, which needs the shipped prerouter and LoRA.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "logits.npz"
PROMPT = [5, 9, 33, 71, 2, 18]
DECODE = 3


def models(root: Path, families: dict | None = None) -> dict:
    """{name: checkpoint}: conftest's families (made here unless given), their YaRN variants, the demo model."""
    from conftest import FAMILIES, REPO, YARN, make_checkpoint
    out = dict(families) if families else {f: make_checkpoint(f, root / f) for f in FAMILIES}
    out.update({f"{f}+yarn": make_checkpoint(f, root / f"{f}-yarn", rope_parameters=YARN[f]) for f in sorted(YARN)})
    out["demo"] = REPO / "data" / "models" / "demo-moe"
    return out


def presets_for(name: str) -> list[str]:
    from workbench.presets import PRESETS
    return [p for p in PRESETS if p != "edge0" or name == "demo"]    # edge0's artifacts ship with the demo only


def logits_of(model: Path, preset: str) -> np.ndarray:
    """(len(PROMPT) + DECODE, vocab): every prefill row, then one row per greedy decode step."""
    from runtime.session import open_session
    with open_session(str(model), preset, prompt=PROMPT, tokens=DECODE + 1, engine="numpy") as s:
        s.engine.reset()
        rows = [s.step(PROMPT, "prefill")]
        for i in range(DECODE):
            rows.append(s.step([int(np.argmax(rows[-1][-1]))], "decode"))
        return np.concatenate(rows, 0)


def machine() -> str:
    """What decides the bits besides the code: the CPU architecture, the BLAS kernel set, numpy's SIMD level."""
    import platform

    from threadpoolctl import threadpool_info
    np.ones((2, 2)) @ np.ones((2, 2))                  # load the BLAS, so threadpoolctl sees it
    blas = sorted(f"{i.get('internal_api')}:{i.get('architecture')}" for i in threadpool_info() if i["user_api"] == "blas")
    simd = [f for f in ("AVX512_SKX", "AVX512F", "X86_V3", "X86_V2", "ASIMD")
            if np._core._multiarray_umath.__cpu_features__.get(f)]
    return f"{platform.machine()} {','.join(blas)} {simd[0] if simd else 'baseline'}"


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, np.float32).tobytes()).hexdigest()


def record(root: Path, out: Path = FIXTURE):
    import io

    from workbench.atomic import atomic_write
    arrays = {"machine": np.array(machine())}
    for name, path in models(root).items():
        for preset in presets_for(name):
            lg = logits_of(path, preset)
            arrays[f"{name}/{preset}/sha256"] = np.array(digest(lg))
            arrays[f"{name}/{preset}/last"] = lg[-1].astype(np.float32)
            print(name, preset, lg.shape, file=sys.stderr)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic_write(out, buf.getvalue())
    return out


if __name__ == "__main__":
    import os
    import tempfile
    sys.path.insert(0, str(HERE))
    with tempfile.TemporaryDirectory() as d:
        os.environ["WORKBENCH_CACHE"] = str(Path(d) / "cache")
        os.environ["WORKBENCH_RUNS"] = str(Path(d) / "runs")
        print(record(Path(d)))
