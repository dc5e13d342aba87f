"""lm-evaluation-harness on the workbench engine: `--model workbench --model_args model=demo,preset=les,budget=0.25`.

Registered with lm-eval's model registry as "workbench" when this module is imported. `python -m
workbench eval lm` imports it; for the plain `lm_eval` command, install the plugin hook once
(`python -m evals.lm_eval_adapter --install-plugin`, see evals/README.md), since lm-eval 0.4.13
discovers models only through imports (it has no entry-point group for them).

Scoring follows lm-eval's HFLM: a (context, continuation) pair is encoded as encode(context) and
encode(context + continuation)[len(encode(context)):] (trailing spaces of the context move to the
continuation), an empty context is replaced by the EOS token, and inputs longer than max_length
keep their last max_length tokens. Requests sharing a context reuse its KV cache (Engine.truncate).
"""
from __future__ import annotations

import lm_eval.models  # noqa: F401  (lm-eval's own lazy model table, before ours: get_model loads it only if empty)
import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from evals.common import log_softmax, trim_telemetry


def _float_or_none(v):
    """A model_args value, None where it says none."""
    return None if v in (None, "", "None", "none") else v


@register_model("workbench")
class WorkbenchLM(LM):
    def __init__(self, model: str = "demo", preset: str = "on_demand", budget=None, engine: str | None = None,
                 max_length=None, max_gen_toks=256, direct=True, session=None, progress=True, **kwargs):
        super().__init__()
        from runtime.session import open_session
        if session is None:
            direct = str(direct).lower() not in ("0", "false", "no")
            session = open_session(str(model), str(preset), _float_or_none(budget), prompt=None,
                                   engine=_float_or_none(engine), direct=direct)
            self._owns = True
        else:
            self._owns = False
        self.session = session
        self.model_name = str(model)
        self.max_length = int(max_length) if max_length else int(session.spec.max_position_embeddings)
        self.max_gen_toks = int(max_gen_toks)
        self.progress = str(progress).lower() not in ("0", "false", "no")
        eos = session.spec.eos_token_id
        self.eot_token_id = int(eos) if eos is not None else 0
        self.prefix_token_id = self.eot_token_id
        self._prefix = None                      # (context tokens, its KV length, last-position logits)

    # ------------------------------------------------------------ tokens and forwards

    def tok_encode(self, text: str) -> list[int]:
        return self.session.encode(text) if text else []

    def tok_decode(self, ids) -> str:
        return self.session.decode(ids)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces > 0:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return ctx, whole[len(ctx):]

    def _forward(self, ids) -> np.ndarray:
        self.session.engine.reset()
        self._prefix = None
        return self.session.step(list(ids), "prefill")

    def continuation_logprobs(self, context_enc: list[int], cont_enc: list[int]) -> np.ndarray:
        """Log-probs (len(cont), V) of the positions that predict cont_enc after context_enc."""
        full = list(context_enc) + list(cont_enc)
        n = len(cont_enc)
        if len(full) > self.max_length + 1 or not context_enc:
            logits = self._forward(full[-(self.max_length + 1):][:-1])
            return log_softmax(logits[-n:])
        key = tuple(context_enc)
        if self._prefix is not None and self._prefix[0] == key:     # the context's KV is kept: cut back to it
            self.session.engine.truncate(self._prefix[1])
            last = self._prefix[2]
        else:
            last = self._forward(context_enc)[-1:]
            self._prefix = (key, self.session.engine.pos, last)
        rows = [last]
        if n > 1:
            rows.append(self.session.step(list(cont_enc[:-1]), "prefill"))
        return log_softmax(np.concatenate(rows, 0))

    def _score(self, context_enc, cont_enc) -> tuple[float, bool]:
        trim_telemetry(self.session)
        if not cont_enc:
            return 0.0, True
        lp = self.continuation_logprobs(context_enc, cont_enc)
        cont = np.asarray(cont_enc)
        return float(lp[np.arange(len(cont)), cont].sum()), bool((lp.argmax(-1) == cont).all())

    # ------------------------------------------------------------ the LM API

    def _bar(self, n, desc):
        from tqdm import tqdm
        return tqdm(total=n, desc=desc, disable=not self.progress or self.rank != 0)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self._prefix = None                      # the engine may have run something else since the last call
        pairs = []
        for req in requests:
            context, continuation = req.args
            if context == "":
                ctx, cont = [self.prefix_token_id], self.tok_encode(continuation)
            else:
                ctx, cont = self._encode_pair(context, continuation)
            pairs.append((ctx, cont))
        order = sorted(range(len(pairs)), key=lambda i: (pairs[i][0], i))   # shared contexts next to each other
        out: list = [None] * len(pairs)
        with self._bar(len(pairs), "loglikelihood") as bar:
            for i in order:
                out[i] = self._score(*pairs[i])
                self.cache_hook.add_partial("loglikelihood", requests[i].args, out[i])
                bar.update(1)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils
        self._prefix = None
        out = []
        with self._bar(len(requests), "loglikelihood_rolling") as bar:
            for req in requests:
                (string,) = req.args
                wins = map(utils.make_disjoint_window,
                           utils.get_rolling_token_windows(token_list=self.tok_encode(string),
                                                           prefix_token=self.prefix_token_id,
                                                           max_seq_len=self.max_length, context_len=1))
                total = sum(self._score(ctx, cont)[0] for ctx, cont in wins)
                out.append(total)
                self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
                bar.update(1)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        with self._bar(len(requests), "generate_until") as bar:
            for req in requests:
                context, gen_kwargs = req.args
                gen_kwargs = dict(gen_kwargs or {})
                until = gen_kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                eos_text = self.tok_decode([self.eot_token_id])
                if eos_text and eos_text not in until:
                    until.append(eos_text)
                max_gen = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
                text = self.generate(context, until, max_gen)
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                bar.update(1)
        return out

    def generate(self, context: str, until: list[str], max_gen: int) -> str:
        """Greedy continuation of `context`, cut at the first stop string (or EOS, or max_gen tokens)."""
        trim_telemetry(self.session)
        max_gen = max(1, min(max_gen, self.max_length - 1))
        ids = (self.tok_encode(context) or [self.prefix_token_id])[-(self.max_length - max_gen):]
        logits = self._forward(ids)[-1]
        gen: list[int] = []
        text = ""
        for i in range(max_gen):
            nxt = int(np.argmax(logits))
            if nxt == self.eot_token_id:
                break
            gen.append(nxt)
            text = self.tok_decode(gen)
            if any(s and s in text for s in until):
                break
            if i == max_gen - 1:
                break
            logits = self.session.step([nxt], "decode")[-1]
        for s in until:
            if s and s in text:
                text = text.split(s, 1)[0]
        return text

    # ------------------------------------------------------------ odds and ends

    @property
    def tokenizer_name(self) -> str:
        return f"workbench-{self.model_name}"

    def get_model_info(self) -> dict:
        s = self.session
        return {"workbench_model": self.model_name, "workbench_preset": s.preset.name, "workbench_budget": s.budget_text,
                "workbench_pack": s.pack.content_id()}

    def close(self):
        if self._owns:
            self.session.close()


def install_plugin(target_dir: str | None = None) -> str:
    """Write a .pth file into site-packages so that every lm_eval run in this environment knows "workbench"."""
    import sysconfig
    from pathlib import Path

    from evals.common import REPO
    d = Path(target_dir or sysconfig.get_paths()["purelib"])
    path = d / "workbench_lm_eval.pth"
    path.write_text(f"{REPO}\nimport evals._lm_eval_hook\n")
    return str(path)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--install-plugin", action="store_true",
                    help="write workbench_lm_eval.pth into this environment's site-packages")
    ap.add_argument("--uninstall-plugin", action="store_true")
    a = ap.parse_args()
    if a.install_plugin:
        print(install_plugin())
    elif a.uninstall_plugin:
        import sysconfig
        from pathlib import Path
        p = Path(sysconfig.get_paths()["purelib"]) / "workbench_lm_eval.pth"
        p.unlink(missing_ok=True)
        print(f"removed {p}")
    else:
        ap.print_help()
