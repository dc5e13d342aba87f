"""OpenCompass's model for the server (evals/opencompass/workbench_api.py), run in OpenCompass's own environment
(evals/opencompass/README.md) against a live server: its perplexities are the engine's own log-probabilities."""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from eval_tiny import REPO
from test_eval_server import engine_logprobs, server  # noqa: F401  (the fixture)

# OpenCompass's environment: $WORKBENCH_OPENCOMPASS_PYTHON, else the one `make test` builds, else the README's ~/venvs
_MADE = Path(__file__).resolve().parents[1] / ".venv-opencompass" / "bin" / "python"
OC_PYTHON = Path(os.environ.get("WORKBENCH_OPENCOMPASS_PYTHON") or
                 (_MADE if _MADE.exists() else Path.home() / "venvs" / "opencompass" / "bin" / "python"))
pytestmark = pytest.mark.skipif(not OC_PYTHON.exists(), reason=f"no OpenCompass environment at {OC_PYTHON}")

SCRIPT = """
import json, sys
from evals.opencompass.workbench_api import WorkbenchCompletions
m = WorkbenchCompletions(path="tiny", url=sys.argv[1])
texts = json.loads(sys.argv[2])
print(json.dumps({"ppl": m.get_ppl(texts).tolist(), "masked": m.get_ppl(texts, mask_length=[3, 5]).tolist(),
                  "lengths": [m.get_token_len(t) for t in texts], "gen": m.generate(texts[:1], 4)}))
"""


def test_get_ppl_is_the_mean_token_loss_the_engine_computes(server):  # noqa: F811
    s = server.engine.s
    texts = ["Once upon a time, there was a little girl named Lily.", "The dog ran to the park and played all day."]
    host, port = server.server_address[:2]
    out = subprocess.run([str(OC_PYTHON), "-c", SCRIPT, f"http://{host}:{port}/v1/", json.dumps(texts)],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for i, (text, mask) in enumerate(zip(texts, (3, 5))):
        ids = s.encode(text)
        lps = engine_logprobs(s, ids)[0]
        assert got["lengths"][i] == len(ids)
        assert got["ppl"][i] == pytest.approx(-np.mean(lps[1:]), abs=1e-5)          # every token after the first
        assert got["masked"][i] == pytest.approx(-np.mean(lps[mask:]), abs=1e-5)     # the first `mask` left out
    assert got["gen"] == [s.decode(s.generate(texts[0], tokens=4)["tokens"])]
