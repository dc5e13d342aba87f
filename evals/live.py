"""The teacher's verdict on a run as it generates: per token, KL(teacher || design) and whether their top-1 agree,
the teacher fed the design's own tokens (so both predict from the same text), with a running mean and its standard
error. The live page shows it beside each design (a lossy lever's price, token by token).

    verdict = Verdict("demo")            # the teacher: full precision, every expert resident, exact routing
    verdict.start(prompt_ids)
    verdict.add(token, design_logits)    # the logits the design chose `token` from; returns that token's KL
    verdict.kl, verdict.kl_stderr, verdict.top1, verdict.n
"""
from __future__ import annotations

import numpy as np

from evals.common import log_softmax, mean_stderr
from workbench.errors import WorkbenchError


class Verdict:
    def __init__(self, model: str, engine: str | None = None):
        from runtime.session import open_session
        self.teacher = open_session(model, "teacher", "all", prompt=None, engine=engine)
        if self.teacher.random_weights:
            self.teacher.close()
            raise WorkbenchError(f"{model}: RANDOM weights ({self.teacher.random_weights}): no teacher whose output "
                                 f"means anything to judge against")
        self.kls: list[float] = []
        self.agree: list[bool] = []
        self.logits = None

    def start(self, prompt_ids: list[int]):
        """The teacher reads the prompt (its next-token logits wait for the design's first token)."""
        self.kls, self.agree = [], []
        self.teacher.engine.reset()
        self.logits = self.teacher.step(list(map(int, prompt_ids)), "prefill")[-1]

    def add(self, token: int, logits) -> float:
        """The design chose `token` from `logits` (the same position the teacher last predicted): score it, then
        feed the token to the teacher."""
        lp = log_softmax(np.asarray(logits, dtype=np.float32)[None])[0]
        t = log_softmax(self.logits[None])[0]
        kl = float((np.exp(t) * (t - lp)).sum())
        self.kls.append(kl)
        self.agree.append(int(t.argmax()) == int(lp.argmax()))
        self.logits = self.teacher.step([int(token)], "decode")[-1]
        return kl

    @property
    def n(self) -> int:
        return len(self.kls)

    @property
    def kl(self) -> float:
        return mean_stderr(self.kls)[0]

    @property
    def kl_stderr(self) -> float:
        return mean_stderr(self.kls)[1]

    @property
    def top1(self) -> float:
        return float(np.mean(self.agree)) if self.agree else float("nan")

    def close(self):
        self.teacher.close()
