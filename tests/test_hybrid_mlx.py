"""The MLX engine runs the hybrid family (Gated DeltaNet, gated attention) within 2e-5 of the numpy engine,
every expert resident and streaming in waves, and truncates its linear-attention state exactly: truncate then
re-decode equals a fresh run, on each of the three families."""
from __future__ import annotations

import os

import numpy as np
import pytest

if os.environ.get("WORKBENCH_REQUIRE_MLX"):     # CI (.ci/run) installs it: there a failed import is an error
    import mlx.core as mx  # noqa: F401
else:
    mx = pytest.importorskip("mlx.core", reason="MLX is not importable here: pip install -e '.[mlx]' "
                                                "(mlx on macOS, mlx[cpu] on Linux)")

from test_hybrid import SPLIT, TOKENS  # noqa: E402
from test_mlx_engine import ATOL, EXACT, LES, STAGED, agree  # noqa: E402
from runtime.session import open_session  # noqa: E402


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "minicpmv4_7"])
def test_matches_numpy_exact_staged_and_les(hybrid_models, family):
    path = hybrid_models[family]
    agree(path, *EXACT)
    agree(path, *STAGED)
    agree(path, *LES, hits=False)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "minicpmv4_7"])
def test_truncate_then_redecode_equals_a_fresh_run_and_numpy(hybrid_models, family):
    def run(engine, draft):
        with open_session(str(hybrid_models[family]), "resident", engine=engine) as s:
            s.engine.reset()
            s.step(TOKENS[:SPLIT], "prefill")
            if draft:
                s.step(draft, "decode")                 # a rejected speculative draft
                s.engine.truncate(SPLIT)
            return np.concatenate([s.step([t], "decode") for t in TOKENS[SPLIT:]])
    truncated = run("mlx", [250, 251])
    np.testing.assert_array_equal(truncated, run("mlx", None))
    np.testing.assert_allclose(truncated, run("numpy", None), atol=ATOL, rtol=0)
