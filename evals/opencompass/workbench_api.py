"""An OpenCompass model for `python -m workbench serve` (or any OpenAI-compatible server whose /v1/completions
returns prompt log-probabilities with `echo`, as vLLM's does): multiple choice by likelihood.

OpenCompass 0.5.4's own `OpenAI` and `OpenAISDK` models only generate: their `get_ppl` raises
NotImplementedError, so its PPLInferencer cannot use them. This one implements `get_ppl` as OpenCompass's
Hugging Face models do (mean negative log-likelihood per token of each text, the first `mask_length[i]` tokens
left out) from one completions request per text (`max_tokens: 0, echo: true, logprobs: 0`), and `generate`
greedily through the same endpoint. A config names it by its import path (run with the repository on
PYTHONPATH): `type='evals.opencompass.workbench_api.WorkbenchCompletions'`.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

import numpy as np
from opencompass.models.base_api import BaseAPIModel


class WorkbenchCompletions(BaseAPIModel):
    is_api: bool = True

    def __init__(self, path: str, url: str = "http://127.0.0.1:8000/v1/", query_per_second: int = 16,
                 retry: int = 2, max_seq_len: int = 1024, meta_template: Optional[dict] = None, workers: int = 4,
                 timeout: float = 600.0):
        super().__init__(path=path, query_per_second=query_per_second, retry=retry, max_seq_len=max_seq_len,
                         meta_template=meta_template)
        self.url = url.rstrip("/") + "/"
        self.base = self.url[: -len("v1/")] if self.url.endswith("/v1/") else self.url
        self.workers = workers
        self.timeout = timeout

    def _post(self, url: str, body: dict) -> dict:
        data = json.dumps({"model": self.path, **body}).encode()
        err = None
        for attempt in range(self.retry + 1):
            self.wait()
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as e:      # a 4xx is the request's fault: retrying will not help
                msg = e.read().decode(errors="replace")
                if e.code < 500:
                    raise RuntimeError(f"{url}: HTTP {e.code}: {msg}") from None
                err = f"HTTP {e.code}: {msg}"
            except (urllib.error.URLError, OSError) as e:
                err = str(e)
            time.sleep(min(2 ** attempt, 10))
        raise RuntimeError(f"{url}: no answer after {self.retry + 1} tries ({err})")

    def get_token_len(self, prompt: str) -> int:
        return int(self._post(self.base + "tokenize", {"prompt": prompt})["count"])

    def token_logprobs(self, text: str) -> list:
        """log p(token_t | tokens before t) for every token of `text` (the first is None)."""
        r = self._post(self.url + "completions", {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0,
                                                  "temperature": 0})
        return r["choices"][0]["logprobs"]["token_logprobs"]

    def _ppl(self, text: str, mask: int) -> float:
        lps = self.token_logprobs(text)
        scored = [lp for lp in lps[max(1, mask):] if lp is not None]
        return -float(np.mean(scored)) if scored else 0.0

    def get_ppl(self, inputs: List[str], mask_length: Optional[List[int]] = None) -> np.ndarray:
        masks = mask_length or [0] * len(inputs)
        with ThreadPoolExecutor(self.workers) as ex:
            return np.array(list(ex.map(self._ppl, inputs, masks)))

    def _generate(self, prompt: str, max_out_len: int) -> str:
        r = self._post(self.url + "completions", {"prompt": prompt, "max_tokens": max_out_len, "temperature": 0})
        return r["choices"][0]["text"]

    def generate(self, inputs: List[str], max_out_len: int = 16) -> List[str]:
        with ThreadPoolExecutor(self.workers) as ex:
            return list(ex.map(self._generate, inputs, [max_out_len] * len(inputs)))
