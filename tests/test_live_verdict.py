"""The teacher's live verdict (evals.live.Verdict): per token KL(teacher || design) and top-1 agreement, the teacher
fed the design's own text."""
from __future__ import annotations

import numpy as np

from evals.common import log_softmax
from evals.live import Verdict
from runtime.session import open_session

PROMPT, TOKENS = [1, 2, 3, 4, 5], [6, 7, 8, 9]


def test_the_teacher_judging_its_own_logits_finds_no_difference():
    v = Verdict("demo")
    with open_session("demo", "teacher", "all", prompt=None) as t:
        logits = t.step(PROMPT, "prefill")[-1]
        v.start(PROMPT)
        for tok in TOKENS:
            assert abs(v.add(tok, logits)) < 1e-9
            logits = t.step([tok], "decode")[-1]
    assert v.n == len(TOKENS) and v.top1 == 1.0 and abs(v.kl) < 1e-9
    v.close()


def test_each_tokens_kl_is_the_teachers_distribution_against_the_designs():
    v = Verdict("demo")
    rng = np.random.default_rng(0)
    with open_session("demo", "teacher", "all", prompt=None) as t:
        teacher = t.step(PROMPT, "prefill")[-1]
    v.start(PROMPT)
    other = teacher + rng.normal(0, 1, teacher.shape).astype(np.float32)
    p, q = log_softmax(teacher[None])[0], log_softmax(other[None])[0]
    assert np.isclose(v.add(TOKENS[0], other), float((np.exp(p) * (p - q)).sum()), rtol=1e-6)
    assert v.top1 == float(p.argmax() == q.argmax())
    v.close()
