"""The OpenAI-compatible server (evals.server) over a real socket."""
import http.client
import json
import socket
import struct
import threading
import time

import numpy as np
import pytest

from eval_tiny import CTX, use_tiny


@pytest.fixture
def server(monkeypatch, tmp_path):
    from evals.server import make_server
    from runtime.session import open_session
    tiny = use_tiny(monkeypatch, tmp_path)
    s = open_session(tiny, "les", direct=False)
    srv = make_server(s, "127.0.0.1", 0, model_id="tiny", quiet=True)
    th = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    th.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    th.join(5)
    s.close()


def call(srv, method, path, body=None, raw: bytes | None = None, timeout=60):
    host, port = srv.server_address[:2]
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    c.request(method, path, body=data, headers={"Content-Type": "application/json"} if data is not None else {})
    r = c.getresponse()
    payload = r.read()
    c.close()
    return r.status, r.getheader("Content-Type"), payload


def jcall(srv, method, path, body=None, raw=None):
    status, ctype, payload = call(srv, method, path, body, raw)
    assert ctype == "application/json", (status, payload[:200])
    return status, json.loads(payload)


def engine_logprobs(session, ids):
    session.engine.reset()
    x = session.engine.forward(np.asarray(ids), "prefill").astype(np.float64)
    m = x.max(-1, keepdims=True)
    lsm = x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
    return [None] + [float(lsm[j, ids[j + 1]]) for j in range(len(ids) - 1)], lsm


@pytest.mark.macos
def test_health_and_models(server, surface):
    assert server.engine.s.reader.mode == ("page-cache+pread" if surface == "macos" else "page-cache")
    st, health = jcall(server, "GET", "/health")
    assert st == 200 and {k: v for k, v in health.items() if k != "served"} == {
        "status": "ok", "model": "tiny", "preset": "les", "budget": "0.25", "context": CTX}
    st, body = jcall(server, "GET", "/v1/models")
    assert st == 200 and [m["id"] for m in body["data"]] == ["tiny"]


def test_health_counts_what_the_engine_served(server):
    before = jcall(server, "GET", "/health")[1]["served"]
    st, body = jcall(server, "POST", "/v1/completions", {"model": "tiny", "prompt": ["Once upon a time", "Tom ran"],
                                                         "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 0})
    after = jcall(server, "GET", "/health")[1]["served"]
    assert st == 200 and after["prefills"] - before["prefills"] == 2
    assert after["prompt_tokens"] - before["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert 0 < after["decode_tokens"] - before["decode_tokens"] < body["usage"]["completion_tokens"]   # the last is not run
    assert after["forward_seconds"] > before["forward_seconds"]


def test_echo_logprobs_equal_the_engines(server):
    s = server.engine.s
    prompt = "Once upon a time, there was a little girl named Lily."
    st, body = jcall(server, "POST", "/v1/completions",
                     {"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert st == 200
    ch = body["choices"][0]
    ids = s.encode(prompt)
    want, lsm = engine_logprobs(s, ids)
    lp = ch["logprobs"]
    assert ch["text"] == prompt and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == len(ids) == len(lp["tokens"]) == len(lp["text_offset"])
    assert np.allclose(lp["token_logprobs"][1:], want[1:], atol=1e-5)
    assert "".join(lp["tokens"]) == prompt and lp["text_offset"][0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))
    for j, top in enumerate(lp["top_logprobs"][1:]):
        (tok, v), = top.items()
        assert v == pytest.approx(lsm[j].max(), abs=1e-5) and tok == s.decode([int(lsm[j].argmax())])
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}


def test_lm_eval_local_completions_request_shape(server):
    """What lm-eval's local-completions sends: token-id prompts in a batch, echo, max_tokens=1, logprobs=1."""
    s = server.engine.s
    ctx, conts = s.encode("Tom had a red ball."), [s.encode(" He"), s.encode(" The dog ran")]
    prompts = [ctx + c for c in conts]
    st, body = jcall(server, "POST", "/v1/completions", {"model": "tiny", "prompt": prompts, "temperature": 0,
                                                         "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
    assert st == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    for p, ch in zip(prompts, body["choices"]):
        assert len(ch["logprobs"]["token_logprobs"]) == len(p) + 1          # the prompt, then the generated token
        assert np.allclose(ch["logprobs"]["token_logprobs"][1:len(p)], engine_logprobs(s, p)[0][1:], atol=1e-5)
    pytest.importorskip("lm_eval")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from evals.lm_eval_adapter import WorkbenchLM
    parsed = LocalCompletionsAPI.parse_logprobs(body, tokens=prompts, ctxlens=[len(ctx)] * 2)
    from lm_eval.api.instance import Instance
    direct = WorkbenchLM(session=s, progress=False).loglikelihood(
        [Instance(request_type="loglikelihood", doc={}, arguments=("Tom had a red ball.", c), idx=0)
         for c in (" He", " The dog ran")])
    for (a, ga), (b, gb) in zip(parsed, direct):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb


@pytest.mark.macos
def test_completion_is_greedy_and_chat_streams_the_same_text(server):
    s = server.engine.s
    st, body = jcall(server, "POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8,
                                                         "temperature": 0})
    assert st == 200
    ref = s.generate("Once upon a time", tokens=8)["tokens"]
    eos = s.spec.eos_token_id
    ref = ref[:ref.index(eos)] if eos in ref else ref     # the server stops at EOS
    assert body["choices"][0]["text"] == s.decode(ref)
    assert body["choices"][0]["finish_reason"] == ("stop" if len(ref) < 8 else "length")
    req = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12,
           "temperature": 0, "stop": ["zzzz"]}
    st, full = jcall(server, "POST", "/v1/chat/completions", req)
    assert st == 200 and full["choices"][0]["message"]["role"] == "assistant"
    st, ctype, raw = call(server, "POST", "/v1/chat/completions", {**req, "stream": True})
    assert st == 200 and ctype == "text/event-stream"
    events = [l[6:] for l in raw.decode().split("\n\n") if l.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]


def test_stop_sequences_cut_the_text(server):
    st, body = jcall(server, "POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 20,
                                                         "temperature": 0})
    text = body["choices"][0]["text"]
    stop = text[3:5]
    if not stop.strip():
        pytest.skip("generated text too uniform to pick a stop string")
    st, cut = jcall(server, "POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 20,
                                                        "temperature": 0, "stop": stop})
    assert cut["choices"][0]["text"] == text.split(stop, 1)[0] and cut["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("method,path,body,raw,status,code", [
    ("POST", "/v1/completions", None, b"{not json", 400, None),
    ("POST", "/v1/completions", None, b"[1, 2]", 400, None),
    ("POST", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, None, 404, "model_not_found"),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, None, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": CTX}, None, 400, "context_length_exceeded"),
    ("POST", "/v1/completions", {"prompt": list(range(CTX + 1)), "max_tokens": 0}, None, 400,
     "context_length_exceeded"),
    ("POST", "/v1/completions", {"prompt": [5, -3]}, None, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "logprobs": -1}, None, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, None, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "n": 3}, None, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "min_tokens": -1}, None, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "stop": 7}, None, 400, None),
    ("POST", "/v1/completions", {"prompt": ""}, None, 400, None),
    ("POST", "/v1/completions", {}, None, 400, None),
    ("POST", "/v1/chat/completions", {"messages": []}, None, 400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -2}, None, 400,
     None),
    ("GET", "/v1/completions", None, None, 405, None),
    ("GET", "/v2/nothing", None, None, 404, None),
])
def test_bad_requests_get_4xx_json(server, method, path, body, raw, status, code):
    st, err = jcall(server, method, path, body, raw)
    assert st == status and isinstance(err["error"]["message"], str) and err["error"]["message"]
    if code:
        assert err["error"]["code"] == code
    assert jcall(server, "GET", "/health")[0] == 200


def test_bad_request_on_a_kept_alive_connection_leaves_it_usable(server):
    host, port = server.server_address[:2]
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("POST", "/v2/unknown", body=b'{"prompt": "a long body the server never parses"}',
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 404 and "error" in json.loads(r.read())
    c.request("GET", "/health")
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    c.close()


@pytest.mark.macos
def test_concurrent_requests_share_the_engine_safely(server):
    prompts = ["Once upon a time", "The little dog", "Lily saw a bird", "Tom and Sam"]
    ref = {p: jcall(server, "POST", "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0,
                                                        "logprobs": 2, "echo": True})[1] for p in prompts}
    results, errors = [], []

    def worker(p):
        try:
            results.append((p, jcall(server, "POST", "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0,
                                                                          "logprobs": 2, "echo": True})))
        except Exception as e:   # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 12
    done = [(p, body) for p, (st, body) in results if st == 200]
    busy = [body for p, (st, body) in results if st != 200]
    assert len(done) >= server.max_waiting + 1, "the running request and every one that found a place waiting"
    assert all(b["error"]["code"] == "rate_limit_exceeded" for b in busy)
    for p, body in done:
        a, b = body["choices"][0], ref[p]["choices"][0]
        assert a["text"] == b["text"]
        assert np.allclose(a["logprobs"]["token_logprobs"][1:], b["logprobs"]["token_logprobs"][1:], atol=1e-5)


def test_client_disconnect_mid_stream_does_not_kill_the_server(server):
    host, port = server.server_address[:2]
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
                       "max_tokens": CTX - 40, "temperature": 0, "stop": ["zzzzz"]}).encode()
    for _ in range(2):
        sock = socket.create_connection((host, port), timeout=30)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b"data: " not in got:
            got += sock.recv(4096)
        assert got.startswith(b"HTTP/1.1 200")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # reset, not a clean close
        sock.close()
    deadline = time.time() + 60
    while server.disconnects < 1 and time.time() < deadline:
        time.sleep(0.05)
    # the engine is free again and the server answers
    st, out = jcall(server, "POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3,
                                                        "temperature": 0})
    assert st == 200 and out["usage"]["completion_tokens"] <= 3
    assert jcall(server, "GET", "/health")[0] == 200
    assert server.disconnects >= 1


class _StubEngine:
    """ServedSession-shaped stub: the model always prefers EOS (id 0), then token 1 ('a'), then 2 ('b')."""
    eos, ctx = 0, 64

    class s:
        class tel:
            events, tokens = [], []
            lock = threading.Lock()

    def _row(self):
        return np.array([5.0, 4.0, 3.0, 0.0])

    def prefill(self, ids):
        return np.stack([self._row()] * len(ids))

    def decode_step(self, tok):
        return self._row()

    def decode(self, ids):
        return "".join({1: "a", 2: "b", 3: "c"}.get(int(t), "") for t in ids)

    def token_str(self, i):
        return self.decode([i])

    def top(self, row, n):
        return {}


def test_min_tokens_holds_back_eos_and_stops_cut_the_stream():
    from evals.server import generate
    eng = _StubEngine()
    assert generate(eng, [3], 5, 0.0, 1.0, [], None, False, None)["finish_reason"] == "stop"   # EOS at once
    r = generate(eng, [3], 5, 0.0, 1.0, [], None, False, None, min_tokens=3)
    assert r["gen_ids"] == [1, 1, 1] and r["text"] == "aaa" and r["finish_reason"] == "stop"
    pieces = []
    r = generate(eng, [3], 6, 0.0, 1.0, ["aaab"], None, False, None, on_text=pieces.append, min_tokens=6)
    assert r["text"] == "aaaaaa" and "".join(pieces) == "aaaaaa"          # held back while "aaab" could start
    r = generate(eng, [3], 6, 0.0, 1.0, ["aa"], None, False, None, on_text=pieces.append, min_tokens=6)
    assert r["text"] == "" and r["finish_reason"] == "stop"


def test_safe_len_holds_back_stop_prefixes_and_partial_characters():
    from evals.server import _safe_len
    assert _safe_len("hello wor", ["world"]) == 6
    assert _safe_len("hello", ["xyz"]) == 5
    assert _safe_len("caf\ufffd", []) == 3


# ---------------------------------------------------------------- limits: key, sizes, queue, connections, slow clients

@pytest.fixture
def limited(monkeypatch, tmp_path):
    """make(**limits): a server on the tiny model with its own limits (evals.server.Server's keywords)."""
    from evals.server import make_server
    from runtime.session import open_session
    s = open_session(use_tiny(monkeypatch, tmp_path), "les", direct=False)
    made = []

    def make(**limits):
        srv = make_server(s, "127.0.0.1", 0, model_id="tiny", quiet=True, **limits)
        th = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        th.start()
        made.append((srv, th))
        return srv
    yield make
    for srv, th in made:
        srv.shutdown()
        srv.server_close()
        th.join(5)
    s.close()


def keyed(srv, method, path, key=None, body=None):
    host, port = srv.server_address[:2]
    c = http.client.HTTPConnection(host, port, timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": key} if key else {})}
    c.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    r = c.getresponse()
    out = r.status, dict(r.getheaders()), json.loads(r.read())
    c.close()
    return out


def test_the_server_listens_on_localhost_unless_told(monkeypatch):
    import inspect
    from evals.server import is_loopback, make_server, serve
    import cli  # noqa: F401  (registers the verbs)
    from workbench.commands import parser
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(make_server).parameters["host"].default == "127.0.0.1"
    assert parser().parse_args(["serve", "--model", "demo"]).host == "127.0.0.1"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.168.1.20")


def test_an_api_key_guards_every_endpoint_but_health(limited):
    srv = limited(api_key="s3cret")
    for path in ("/v1/models", "/tokenizer_info"):
        st, headers, err = keyed(srv, "GET", path)
        assert st == 401 and err["error"]["code"] == "invalid_api_key" and headers["WWW-Authenticate"] == "Bearer"
        assert keyed(srv, "GET", path, "Bearer wrong")[0] == 401
        assert keyed(srv, "GET", path, "Basic s3cret")[0] == 401
        assert keyed(srv, "GET", path, "Bearer s3cret")[0] == 200
    body = {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}
    assert keyed(srv, "POST", "/v1/completions", None, body)[0] == 401
    assert keyed(srv, "POST", "/v1/completions", "Bearer s3cret", body)[0] == 200
    assert keyed(srv, "GET", "/health")[0] == 200


def test_tokenizer_info_gives_the_real_special_tokens(server):
    """lm-eval's remote tokenizer encodes bos_token (else eos_token) to score an empty context: "" there was an
    IndexError inside lm-eval."""
    st, info = jcall(server, "GET", "/tokenizer_info")
    s = server.engine.s
    assert st == 200 and info["eos_token"] == info["bos_token"] == "<|endoftext|>" == s.tokenizer.id_to_token(0)
    st, enc = jcall(server, "POST", "/tokenize", {"prompt": info["bos_token"], "add_special_tokens": False})
    assert enc["tokens"] == [s.spec.bos_token_id] == [s.spec.eos_token_id]


def test_an_oversize_body_is_refused_413_and_the_next_request_answered(limited, monkeypatch):
    import evals.server as S
    monkeypatch.setattr(S, "MAX_BODY", 2**16)
    srv = limited()
    st, _, err = call(srv, "POST", "/v1/completions", raw=b'{"prompt": "' + b"a" * 2**17 + b'"}')
    assert st == 413 and "over 65536 bytes" in json.loads(err)["error"]["message"]
    st, _, err = call(srv, "POST", "/v1/completions", raw=b"[" * 20_000 + b"]" * 20_000)
    assert st == 400 and "nested too deeply" in json.loads(err)["error"]["message"]
    assert jcall(srv, "GET", "/health")[0] == 200


def test_a_full_queue_answers_429_and_frees_when_the_engine_does(limited):
    srv = limited(max_waiting=2)
    body = {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}
    got = []
    srv.engine.lock.acquire()       # the engine busy: requests take their places in the queue and wait
    try:
        waiting = [threading.Thread(target=lambda: got.append(jcall(srv, "POST", "/v1/completions", body)[0]))
                   for _ in range(3)]
        for t in waiting:
            t.start()
        deadline = time.time() + 30
        while srv.turns._value > 0 and time.time() < deadline:
            time.sleep(0.02)
        st, headers, err = keyed(srv, "POST", "/v1/completions", None, body)
        assert st == 429 and headers["Retry-After"] == "1" and err["error"]["code"] == "rate_limit_exceeded"
        assert keyed(srv, "GET", "/health")[0] == 200, "what needs no engine is answered meanwhile"
    finally:
        srv.engine.lock.release()
    for t in waiting:
        t.join(60)
    assert got == [200, 200, 200]
    assert keyed(srv, "POST", "/v1/completions", None, body)[0] == 200


def test_connections_over_the_cap_are_answered_429_at_the_door(limited):
    srv = limited(max_connections=3)
    idle = [socket.create_connection(srv.server_address[:2], timeout=10) for _ in range(3)]
    try:
        deadline = time.time() + 10
        while srv.open < 3 and time.time() < deadline:
            time.sleep(0.02)
        extra = socket.create_connection(srv.server_address[:2], timeout=10)
        answer = b""
        while chunk := extra.recv(4096):
            answer += chunk
        extra.close()
        assert answer.startswith(b"HTTP/1.1 429 ") and b"too many connections (at most 3)" in answer
        assert srv.refused == 1
    finally:
        for s in idle:
            s.close()
    deadline = time.time() + 10
    while srv.open and time.time() < deadline:
        time.sleep(0.02)
    assert jcall(srv, "GET", "/health")[0] == 200


def test_a_slow_loris_is_dropped_and_a_slow_body_answered_408(limited):
    srv = limited(read_timeout=1.0)
    loris = socket.create_connection(srv.server_address[:2], timeout=10)
    t0, closed = time.time(), False
    try:
        for ch in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 40:
            loris.sendall(bytes([ch]))          # a byte at a time, each well inside any per-read timeout
            time.sleep(0.1)
    except OSError:
        closed = True
    if not closed:
        loris.settimeout(5)
        closed = loris.recv(4096) == b""
    loris.close()
    assert closed and time.time() - t0 < 6, "the server hung up once the request was not in after read_timeout"
    slow = socket.create_connection(srv.server_address[:2], timeout=10)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\"")
    answer = b""
    while chunk := slow.recv(4096):
        answer += chunk
    slow.close()
    assert answer.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1 s" in answer
    assert jcall(srv, "GET", "/health")[0] == 200
