"""An OpenAI-compatible HTTP server on one workbench Session (standard library ThreadingHTTPServer).

    python -m workbench serve --model demo --preset les --port 8000

Endpoints: GET /health, GET /v1/models, POST /v1/completions (echo + logprobs: lm-eval's
`local-completions` can score log-likelihoods), POST /v1/chat/completions (stream=true sends SSE
chunks), and vLLM-style POST /tokenize, POST /detokenize, GET /tokenizer_info (lm-eval's remote
tokenizer). Requests are validated and refused with a 4xx JSON error; one engine serves every
request, one at a time, behind a lock; a client that goes away mid-stream ends only its own request.

Limits (docs/booth.md; measured in results/server_limits.md): it listens on 127.0.0.1 unless --host says otherwise;
with an API key (--api-key or WORKBENCH_API_KEY) every endpoint but /health wants `Authorization: Bearer KEY` (401);
a body over MAX_BODY is refused (413); a request must arrive whole within READ_TIMEOUT s of the connection's last
answer (408, or the connection closed); at most MAX_WAITING generation requests wait behind the one running (429
with Retry-After); at most MAX_CONNECTIONS connections are open at once (the next is answered 429 and closed).
"""
from __future__ import annotations

import contextlib
import hmac
import io
import ipaddress
import json
import math
import os
import queue
import secrets
import selectors
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import numpy as np

from evals.common import log_softmax, trim_telemetry
from workbench.chat import render
from workbench.errors import WorkbenchError

MAX_BODY = 2 * 2**20        # 64 prompts of 4096 token ids fit
MAX_WAITING = 8             # generation requests queued behind the running one
MAX_CONNECTIONS = 128
READ_TIMEOUT = 20.0         # seconds from the last answer (or the connection) to a whole request
LINGER_S = 1.0              # a refused connection is read (and dropped) this long before it is closed
MAX_LOGPROBS = 20
ROLES = ("system", "user", "assistant")
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}Assistant:{% endif %}")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def chat_prompt(messages: list[dict]) -> str:
    """The simple chat template: one 'Role: content' line per message, then 'Assistant:'."""
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"


# ------------------------------------------------------------------ validation helpers

def _int(body, key, default, lo=None, hi=None, allow_none=False):
    v = body.get(key, default)
    if v is None and (allow_none or default is None):
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{key}' must be an integer", key)
    if lo is not None and v < lo:
        raise ApiError(400, f"'{key}' must be >= {lo} (got {v})", key)
    if hi is not None and v > hi:
        raise ApiError(400, f"'{key}' must be <= {hi} (got {v})", key)
    return v


def _num(body, key, default, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(400, f"'{key}' must be a number", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ApiError(400, f"'{key}' must be between {lo} and {hi} (got {v})", key)
    return float(v)


def _bool(body, key, default=False):
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"'{key}' must be true or false", key)
    return v


def _stop(body) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v) or len(v) > 4:
        raise ApiError(400, "'stop' must be a string or a list of up to 4 strings", "stop")
    return [s for s in v if s]


class ServedSession:
    """The shared Session: tokenization is thread-safe, the forward pass is behind `lock`."""

    def __init__(self, session, model_id: str):
        self.s = session
        self.model_id = model_id
        self.lock = threading.Lock()
        self.ctx = int(session.spec.max_position_embeddings)
        self.eos = session.spec.eos_token_id
        self.created = int(time.time())
        self.template = session.pack.header.get("chat_template")     # the model's own, when it has one
        self.served = {"prefills": 0, "prompt_tokens": 0, "decode_tokens": 0, "forward_seconds": 0.0}

    def chat_prompt(self, messages: list[dict]) -> str:
        if not self.template:
            return chat_prompt(messages)
        try:
            return render(self.template, messages, self.special(self.s.spec.bos_token_id) or "",
                          self.special(self.eos) or "")
        except Exception as e:      # the template's own raise_exception, or a Jinja error in it
            raise ApiError(400, f"the model's chat template refused these messages: {e}", "messages") from None

    def encode(self, text: str) -> list[int]:
        return self.s.encode(text)

    def decode(self, ids) -> str:
        return self.s.decode(ids)

    def special(self, i: int | None) -> str | None:
        """A special token's own text (decode drops special tokens: `<|endoftext|>` decodes to "")."""
        if i is None:
            return None
        tok = self.s.tokenizer
        return (tok.id_to_token(int(i)) if tok is not None else None) or self.decode([i]) or None

    def token_str(self, i: int) -> str:
        return self.s.decode([int(i)])

    def prefill(self, ids) -> np.ndarray:
        t0 = time.perf_counter()
        self.s.engine.reset()
        logits = self.s.step(list(map(int, ids)), "prefill")
        self._count(prefills=1, prompt_tokens=len(ids), forward_seconds=time.perf_counter() - t0)
        return logits

    def decode_step(self, tok: int) -> np.ndarray:
        t0 = time.perf_counter()
        row = self.s.step([int(tok)], "decode")[-1]
        self._count(decode_tokens=1, forward_seconds=time.perf_counter() - t0)
        return row

    def _count(self, **kw):
        """The totals /health reports (runs under `lock`, as every forward pass)."""
        for k, v in kw.items():
            self.served[k] += v

    def top(self, lp_row: np.ndarray, n: int) -> dict:
        if n <= 0:
            return {}
        idx = np.argpartition(-lp_row, n - 1)[:n]
        idx = idx[np.argsort(-lp_row[idx], kind="stable")]
        out = {}
        for i in idx:
            out.setdefault(self.token_str(i), float(lp_row[i]))
        return out


def _pick(logits_row: np.ndarray, temperature: float, top_p: float, rng) -> int:
    if temperature <= 0:
        return int(np.argmax(logits_row))
    p = np.exp(log_softmax(logits_row[None] / temperature)[0])
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return int(rng.choice(len(p), p=p))


def _safe_len(text: str, stops: list[str]) -> int:
    """How much of `text` can be sent: hold back an unfinished UTF-8 character and any suffix that may start a stop."""
    n = len(text)
    if text.endswith("\ufffd"):
        n -= 1
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, n), 0, -1):
            if text[:n].endswith(s[:k]):
                hold = max(hold, k)
                break
    return n - hold


def generate(eng: ServedSession, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float, stops: list[str],
             logprobs: int | None, echo: bool, seed: int | None, on_text=None, min_tokens: int = 0) -> dict:
    """Runs under eng.lock. on_text(delta) is called with text that is final (stop strings held back).
    min_tokens (vLLM's extension): EOS cannot be picked before that many tokens."""
    rng = np.random.default_rng(seed)
    logits = eng.prefill(prompt_ids)
    want_lp = logprobs is not None
    res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "gen_ids": []}
    if want_lp and echo:
        lp = log_softmax(logits[:-1])
        res["tokens"] = [eng.token_str(t) for t in prompt_ids]
        res["token_logprobs"] = [None] + [float(lp[j, prompt_ids[j + 1]]) for j in range(len(prompt_ids) - 1)]
        res["top_logprobs"] = [None] + [eng.top(lp[j], logprobs) for j in range(len(prompt_ids) - 1)]
    row = logits[-1]
    gen, text, sent, finish = [], "", 0, "length"
    for i in range(max_tokens):
        if i < min_tokens and eng.eos is not None:
            masked = row.copy()
            masked[eng.eos] = -np.inf
            nxt = _pick(masked, temperature, top_p, rng)
        else:
            nxt = _pick(row, temperature, top_p, rng)
        if want_lp:
            lp_row = log_softmax(row[None])[0]
            res["tokens"].append(eng.token_str(nxt))
            res["token_logprobs"].append(float(lp_row[nxt]))
            res["top_logprobs"].append(eng.top(lp_row, logprobs))
        if eng.eos is not None and nxt == eng.eos:
            finish = "stop"
            break
        gen.append(nxt)
        text = eng.decode(gen)
        hit = min((text.find(s) for s in stops if s in text), default=-1)
        if hit >= 0:
            text, finish = text[:hit], "stop"
            break
        if on_text is not None:
            n = _safe_len(text, stops)
            if n > sent:
                on_text(text[sent:n])
                sent = n
        if i < max_tokens - 1:
            row = eng.decode_step(nxt)
    trim_telemetry(eng.s)
    if on_text is not None and len(text) > sent:
        on_text(text[sent:])
    res.update(text=text, finish_reason=finish, gen_ids=gen)
    return res


class _Deadline(io.RawIOBase):
    """The request side of a connection: a read past `until` (time.monotonic) raises TimeoutError, however slowly
    the bytes trickle in (a slow-loris client resets a plain socket timeout with every byte)."""

    def __init__(self, sock):
        self.sock, self.until = sock, None

    def readable(self):
        return True

    def readinto(self, b):
        if self.until is not None:
            left = self.until - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request did not arrive in time")
            self.sock.settimeout(left)
        return self.sock.recv_into(b)


class Handler(BaseHTTPRequestHandler):
    server_version = "workbench-serve/0.1"
    protocol_version = "HTTP/1.1"
    timeout = 120                              # socket timeout for writes: a client that stops reading is dropped

    @property
    def eng(self) -> ServedSession:
        return self.server.engine

    def setup(self):
        super().setup()
        self._in = _Deadline(self.connection)
        self.rfile = io.BufferedReader(self._in, self.rbufsize if self.rbufsize > 0 else io.DEFAULT_BUFFER_SIZE)

    def handle_one_request(self):
        self._in.until = time.monotonic() + self.server.read_timeout
        super().handle_one_request()

    def _received(self):
        """The whole request is in: what follows (generation, the answer) runs under the write timeout."""
        self._in.until = None
        self.connection.settimeout(self.timeout)

    def log_message(self, fmt, *args):
        if not self.server.quiet:
            sys.stderr.write("%s - %s\n" % (self.address_string(), fmt % args))

    # -------------------------------------------------------------- plumbing

    def _send_json(self, status: int, obj: dict, headers: dict | None = None):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self):
        """Read the whole request body before anything else, so a refused request leaves the connection clean."""
        self._raw, self._unread = b"", 0
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise ApiError(411, "chunked request bodies are not supported; send Content-Length")
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            n = -1
        if n < 0:
            self.close_connection = True
            raise ApiError(400, "bad Content-Length")
        if n > MAX_BODY:
            self.close_connection, self._unread = True, n
            raise ApiError(413, f"request body over {MAX_BODY} bytes")
        try:
            self._raw = self.rfile.read(n) if n else b""
        except TimeoutError:
            self.close_connection = True
            raise ApiError(408, f"the request body did not arrive within {self.server.read_timeout:g} s") from None
        if len(self._raw) < n:
            self.close_connection = True
            raise ApiError(400, "request body shorter than Content-Length")

    def _body(self) -> dict:
        try:
            body = json.loads(self._raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}")
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def _dispatch(self, method: str):
        path = urlsplit(self.path).path.rstrip("/") or "/"
        routes = {
            ("GET", "/health"): self.health, ("GET", "/v1/models"): self.models,
            ("GET", "/tokenizer_info"): self.tokenizer_info,
            ("POST", "/v1/completions"): self.completions, ("POST", "/v1/chat/completions"): self.chat,
            ("POST", "/tokenize"): self.tokenize, ("POST", "/detokenize"): self.detokenize,
        }
        try:
            if method != "GET":
                self._read_body()
            self._received()
            if self.server.api_key is not None and (method, path) != ("GET", "/health"):
                self._check_key()
            fn = routes.get((method, path))
            if fn is None:
                if any(p == path for (_, p) in routes):
                    raise ApiError(405, f"{method} not allowed on {path}")
                raise ApiError(404, f"no route {path}", code="not_found")
            fn()
        except ApiError as e:
            self._received()
            self._try_send(e.status, e.body(), e.headers)
            if getattr(self, "_unread", 0):
                self._linger(self._unread)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
        except WorkbenchError as e:   # the model's files failed (a read, a checksum): one line naming them
            self._try_send(500, ApiError(500, str(e), type_="server_error").body())
        except Exception as e:        # a bug must answer 500, not kill the server
            import traceback
            traceback.print_exc()
            self._try_send(500, ApiError(500, f"internal error: {type(e).__name__}: {e}", type_="server_error").body())

    def _linger(self, n: int):
        """After refusing a body unread: take (and drop) what the client still sends, for a moment, so that the
        close does not reset the connection before the client has read the answer."""
        self._in.until = time.monotonic() + 2.0
        try:
            while n > 0 and (got := self.rfile.read1(min(n, 2**16))):
                n -= len(got)
        except (OSError, ValueError):
            pass

    def _try_send(self, status, obj, headers=None):
        try:
            self._send_json(status, obj, headers)
        except (BrokenPipeError, ConnectionResetError, TimeoutError, ValueError):
            self.close_connection = True

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    # -------------------------------------------------------------- simple endpoints

    def health(self):
        s = self.eng.s
        self._send_json(200, {"status": "ok", "model": self.eng.model_id, "preset": s.preset.name,
                              "budget": s.budget_text, "context": self.eng.ctx, "served": dict(self.eng.served)})

    def models(self):
        self._send_json(200, {"object": "list", "data": [{"id": self.eng.model_id, "object": "model",
                                                          "created": self.eng.created, "owned_by": "workbench",
                                                          "max_model_len": self.eng.ctx}]})

    def tokenizer_info(self):
        """lm-eval's remote tokenizer reads bos_token (else eos_token) and encodes it to score an empty context."""
        eos, bos = self.eng.special(self.eng.eos), self.eng.special(self.eng.s.spec.bos_token_id)
        self._send_json(200, {"eos_token": eos, "bos_token": bos, "pad_token": eos, "model_max_length": self.eng.ctx,
                              "chat_template": self.eng.template or CHAT_TEMPLATE, "tokenizer_class": "workbench"})

    def tokenize(self):
        body = self._body()
        self._check_model(body)
        if "messages" in body:
            text = self.eng.chat_prompt(self._messages(body))
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise ApiError(400, "'prompt' must be a string", "prompt")
        ids = self.eng.encode(text)
        self._send_json(200, {"tokens": ids, "count": len(ids), "max_model_len": self.eng.ctx})

    def detokenize(self):
        body = self._body()
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ApiError(400, "'tokens' must be a list of integers", "tokens")
        self._check_ids(ids, "tokens")
        self._send_json(200, {"prompt": self.eng.decode(ids)})

    # -------------------------------------------------------------- validation

    def _check_key(self):
        got = self.headers.get("Authorization", "")
        scheme, _, key = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.server.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", code="invalid_api_key",
                           type_="authentication_error", headers={"WWW-Authenticate": "Bearer"})

    def _check_model(self, body):
        m = body.get("model")
        if m is not None and m != self.eng.model_id:
            raise ApiError(404, f"model {m!r} does not exist; this server serves {self.eng.model_id!r}", "model",
                           "model_not_found")

    def _check_ids(self, ids, param):
        V = self.eng.s.spec.vocab_size
        if any(t < 0 or t >= V for t in ids):
            raise ApiError(400, f"token ids must be in [0, {V})", param)

    def _prompts(self, body) -> list[list[int]]:
        p = body.get("prompt")
        if p is None:
            raise ApiError(400, "'prompt' is required", "prompt")
        if isinstance(p, str):
            items = [p]
        elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            items = [p]
        elif isinstance(p, list) and p:
            items = p
        else:
            raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids, or a list of those",
                           "prompt")
        out = []
        for it in items:
            if isinstance(it, str):
                ids = self.eng.encode(it)
            elif isinstance(it, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in it):
                ids = list(it)
                self._check_ids(ids, "prompt")
            else:
                raise ApiError(400, "each prompt must be a string or a list of token ids", "prompt")
            if not ids:
                raise ApiError(400, "empty prompt", "prompt")
            out.append(ids)
        if len(out) > 64:
            raise ApiError(400, "at most 64 prompts per request", "prompt")
        return out

    def _messages(self, body) -> list[dict]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        out = []
        for m in msgs:
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise ApiError(400, f"each message needs a role among {', '.join(ROLES)}", "messages")
            c = m.get("content")
            if isinstance(c, list):      # [{"type": "text", "text": ...}, ...]
                if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
                    raise ApiError(400, "only text content parts are supported", "messages")
                c = "".join(x["text"] for x in c)
            if not isinstance(c, str):
                raise ApiError(400, "message content must be a string", "messages")
            out.append({"role": m["role"], "content": c})
        return out

    def _sampling(self, body, max_default):
        mt = max_default
        for k in ("max_tokens", "max_completion_tokens"):
            if body.get(k) is not None:
                mt = _int(body, k, max_default, lo=0)
                break
        return dict(max_tokens=mt, n=_int(body, "n", 1, lo=1, hi=1),
                    temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
                    top_p=_num(body, "top_p", 1.0, 0.0, 1.0) or 1.0, stops=_stop(body),
                    seed=_int(body, "seed", None, allow_none=True), min_tokens=_int(body, "min_tokens", 0, lo=0))

    def _fits(self, n_prompt, max_tokens):
        if n_prompt + max_tokens > self.eng.ctx:
            raise ApiError(400, f"this model's maximum context length is {self.eng.ctx} tokens; the request has "
                                f"{n_prompt} prompt tokens and asks for {max_tokens} more", "max_tokens",
                           "context_length_exceeded")

    @contextlib.contextmanager
    def _turn(self):
        """A place in the queue for the engine (the running request and MAX_WAITING behind it), else 429."""
        if not self.server.turns.acquire(blocking=False):
            raise ApiError(429, f"busy: {self.server.max_waiting} requests already wait for the model; try again",
                           code="rate_limit_exceeded", type_="rate_limit_error", headers={"Retry-After": "1"})
        try:
            yield
        finally:
            self.server.turns.release()

    # -------------------------------------------------------------- completions

    def completions(self):
        body = self._body()
        self._check_model(body)
        prompts = self._prompts(body)
        sp = self._sampling(body, 16)
        echo = _bool(body, "echo")
        stream = _bool(body, "stream")
        logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS, allow_none=True)
        for ids in prompts:
            self._fits(len(ids), sp["max_tokens"])
        if stream and len(prompts) > 1:
            raise ApiError(400, "stream supports one prompt", "prompt")
        cid = f"cmpl-{secrets.token_hex(12)}"
        with self._turn():
            if stream:
                return self._stream(cid, "text_completion", prompts[0], sp, chat=False, echo=echo)
            answer = self._complete(cid, prompts, sp, echo, logprobs)
        self._send_json(200, answer)      # outside the turn: a client slow to read holds no place in the queue

    def _complete(self, cid, prompts, sp, echo, logprobs) -> dict:
        choices, n_prompt, n_gen = [], 0, 0
        for i, ids in enumerate(prompts):
            with self.eng.lock:
                r = generate(self.eng, ids, sp["max_tokens"], sp["temperature"], sp["top_p"], sp["stops"], logprobs,
                             echo, sp["seed"], min_tokens=sp["min_tokens"])
            prompt_text = self.eng.decode(ids)
            text = (prompt_text + r["text"]) if echo else r["text"]
            lp = None
            if logprobs is not None:
                offs, pos = [], 0 if echo else len(prompt_text)
                for t in r["tokens"]:
                    offs.append(pos)
                    pos += len(t)
                lp = {"tokens": r["tokens"], "token_logprobs": r["token_logprobs"], "top_logprobs": r["top_logprobs"],
                      "text_offset": offs}
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": r["finish_reason"]})
            n_prompt += len(ids)
            n_gen += len(r["gen_ids"])
        return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": self.eng.model_id,
                "choices": choices, "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen,
                                              "total_tokens": n_prompt + n_gen}}

    # -------------------------------------------------------------- chat

    def chat(self):
        body = self._body()
        self._check_model(body)
        msgs = self._messages(body)
        ids = self.eng.encode(self.eng.chat_prompt(msgs))
        if not ids:
            raise ApiError(400, "empty prompt", "messages")
        sp = self._sampling(body, max(0, min(256, self.eng.ctx - len(ids))))
        sp["stops"] = sp["stops"] or ["\nUser:", "\nSystem:"]
        self._fits(len(ids), sp["max_tokens"])
        cid = f"chatcmpl-{secrets.token_hex(12)}"
        stream = _bool(body, "stream")
        with self._turn():
            if stream:
                return self._stream(cid, "chat.completion.chunk", ids, sp, chat=True)
            with self.eng.lock:
                r = generate(self.eng, ids, sp["max_tokens"], sp["temperature"], sp["top_p"], sp["stops"], None,
                             False, sp["seed"], min_tokens=sp["min_tokens"])
        text = r["text"].lstrip(" ")
        self._send_json(200, {"id": cid, "object": "chat.completion", "created": int(time.time()),
                              "model": self.eng.model_id,
                              "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                           "logprobs": None, "finish_reason": r["finish_reason"]}],
                              "usage": {"prompt_tokens": len(ids), "completion_tokens": len(r["gen_ids"]),
                                        "total_tokens": len(ids) + len(r["gen_ids"])}})

    # -------------------------------------------------------------- SSE

    def _stream(self, cid, obj, ids, sp, chat: bool, echo: bool = False):
        """SSE. A writer thread owns the socket, so a slow client never holds the engine: generation only queues
        events, and stops (releasing the lock) as soon as the writer finds the client gone."""
        created = int(time.time())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        events: queue.Queue = queue.Queue()
        gone = threading.Event()

        def writer():
            try:
                while (item := events.get()) is not None:
                    self.wfile.write(item)
                    self.wfile.flush()
            except OSError:                  # broken pipe, reset, timeout: the client left
                gone.set()
                with self.server.count_lock:
                    self.server.disconnects += 1

        w = threading.Thread(target=writer, name="sse-writer", daemon=True)
        w.start()

        def send(payload):
            if gone.is_set():
                raise _ClientGone
            events.put(b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n")

        first = [True]

        def chunk(delta_text=None, finish=None):
            if chat:
                delta = {}
                if first[0]:
                    delta["role"] = "assistant"
                if delta_text is not None:
                    delta["content"] = delta_text
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
            first[0] = False
            send({"id": cid, "object": obj, "created": created, "model": self.eng.model_id, "choices": [c]})

        strip = [chat]

        def on_text(delta):
            if strip[0]:                       # the template ends with "Assistant:"; drop the space after it
                delta = delta.lstrip(" ")
                if not delta:
                    return
                strip[0] = False
            chunk(delta)

        try:
            if chat:
                chunk("")
            elif echo:
                chunk(self.eng.decode(ids))
            with self.eng.lock:
                r = generate(self.eng, ids, sp["max_tokens"], sp["temperature"], sp["top_p"], sp["stops"], None, False,
                             sp["seed"], on_text=on_text, min_tokens=sp["min_tokens"])
            chunk(None, r["finish_reason"])
            send(b"[DONE]")
        except _ClientGone:
            pass
        except Exception as e:               # headers are sent: report the error as an event, then close
            if not isinstance(e, WorkbenchError):
                import traceback
                traceback.print_exc()
            if not gone.is_set():
                msg = str(e) if isinstance(e, WorkbenchError) else f"internal error: {type(e).__name__}: {e}"
                events.put(b"data: " + json.dumps(ApiError(500, msg, type_="server_error").body()).encode() + b"\n\n")
        finally:
            events.put(None)
            w.join(self.timeout + 5)


class _ClientGone(Exception):
    pass


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, addr, engine: ServedSession, quiet: bool = False, api_key: str | None = None,
                 max_waiting: int = MAX_WAITING, max_connections: int = MAX_CONNECTIONS,
                 read_timeout: float = READ_TIMEOUT):
        super().__init__(addr, Handler)
        self.engine = engine
        self.quiet = quiet
        self.api_key = api_key or None
        self.max_waiting, self.max_connections, self.read_timeout = max_waiting, max_connections, read_timeout
        self.turns = threading.BoundedSemaphore(max_waiting + 1)
        self.disconnects = 0                  # streams whose client went away (diagnostics, tests)
        self.refused = 0                      # connections answered 429 at the door (over max_connections)
        self.open = 0
        self.count_lock = threading.Lock()
        self.lingering: queue.Queue = queue.Queue()
        threading.Thread(target=self._linger, name="serve-linger", daemon=True).start()

    def process_request(self, request, client_address):
        with self.count_lock:
            full = self.open >= self.max_connections
            self.open += not full
            self.refused += full
        if not full:
            return super().process_request(request, client_address)
        body = json.dumps(ApiError(429, f"too many connections (at most {self.max_connections}); try again",
                                   code="rate_limit_exceeded", type_="rate_limit_error").body()).encode()
        try:        # from the accepting thread: never wait on this client
            request.setblocking(False)
            request.send(b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            request.shutdown(socket.SHUT_WR)
        except OSError:
            request.close()
            return
        self.lingering.put(request)

    def _linger(self):
        """Refused connections, each read (and dropped) for LINGER_S before it is closed: a close with the
        client's request unread would reset the connection, and the client could lose the 429 it was sent."""
        sel, until = selectors.DefaultSelector(), {}
        while True:
            try:
                while True:
                    sock = self.lingering.get(block=not until)
                    if len(until) >= self.max_connections:       # a flood: no lingering for the rest
                        sock.close()
                        continue
                    until[sock] = time.monotonic() + LINGER_S
                    sel.register(sock, selectors.EVENT_READ)
            except queue.Empty:
                pass
            ready = {key.fileobj for key, _ in sel.select(0.05)}
            now = time.monotonic()
            for sock in list(until):
                done = until[sock] < now
                if sock in ready:
                    try:
                        done = done or not sock.recv(2**16)
                    except OSError:
                        done = True
                if done:
                    sel.unregister(sock)
                    sock.close()
                    del until[sock]

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.count_lock:
                self.open -= 1

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, TimeoutError)):
            return
        super().handle_error(request, client_address)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_server(session, host: str = "127.0.0.1", port: int = 8000, model_id: str | None = None,
                quiet: bool = False, **limits) -> Server:
    """limits: api_key, max_waiting, max_connections, read_timeout (Server)."""
    from pathlib import Path
    mid = model_id or Path(str(session.model)).name
    return Server((host, port), ServedSession(session, mid), quiet=quiet, **limits)


def serve(model: str, preset: str, budget=None, host: str = "127.0.0.1", port: int = 8000, model_id: str | None = None,
          engine: str | None = None, direct: bool = True, quiet: bool = False, api_key: str | None = None):
    from runtime.session import open_session
    api_key = api_key or os.environ.get("WORKBENCH_API_KEY") or None
    s = open_session(model, preset, budget, prompt=None, engine=engine, direct=direct)
    try:
        srv = make_server(s, host, port, model_id, quiet, api_key=api_key)
    except OSError as e:
        s.close()
        raise WorkbenchError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
    h, p = srv.server_address[:2]
    print(f"serving {srv.engine.model_id!r} ({s.preset.name}, budget {s.budget_text}) on http://{h}:{p}/v1"
          + (" (API key required)" if api_key else ""), file=sys.stderr, flush=True)
    if not is_loopback(host) and not api_key:
        print(f"WARNING: {host} is reachable from other machines and no API key is set: anyone who reaches "
              f"port {p} can use the model (--api-key, or WORKBENCH_API_KEY)", file=sys.stderr, flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
        s.close()
