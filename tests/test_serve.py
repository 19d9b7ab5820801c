"""`hetero-spec serve`: the OpenAI schema through the official `openai` client (completions, chat, streaming,
stop strings, usage, error codes), disconnects, /health with a killed or hung worker, /metrics, and 32
concurrent streams. A real uvicorn server on a free loopback port serves a tiny-model Engine; nothing here
asserts a wall-clock outcome (waits are bounded, and only for events)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from hetero_spec import Engine
from hetero_spec.scheduler import DONE
from hetero_spec.metrics import Stats
from hetero_spec.serve import create_app
from hetero_spec.serve.schema import StopMatcher

PROMPT = "def read_lines(filename):"
MODEL = "tiny"


class Server:
    """uvicorn in a thread on a free loopback port."""

    def __init__(self, app, **options):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=5, **options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _cfg(target, draft=None, **runtime):
    rt = {"mode": "in_process", **runtime}
    d = {"kind": "onnx", "model": str(draft)} if draft else {"kind": "none"}
    return {"target": {"model": str(target), "dtype": "float32", "device": "cpu"}, "draft": d,
            "speculation": {"gamma": 4}, "runtime": rt}


@pytest.fixture(scope="module")
def served(llama_target, llama_copy_onnx):
    eng = Engine.from_config(_cfg(llama_target, llama_copy_onnx))
    srv = Server(create_app(eng, MODEL))
    yield srv, eng
    srv.close()


def _reference(eng: Engine, prompt, n: int) -> str:
    return eng.generate(prompt, max_new_tokens=n, temperature=0.0).text


def test_models_and_greedy_completion_equal_the_engine(served):
    srv, eng = served
    assert [m.id for m in srv.client.models.list().data] == [MODEL]
    out = srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    ref = eng.generate(PROMPT, max_new_tokens=24, temperature=0.0)
    assert out.choices[0].text == ref.text and out.object == "text_completion"
    assert out.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.prompt_tokens == len(eng.prompt_ids(PROMPT))
    # token ids as the prompt work too
    ids = eng.prompt_ids(PROMPT)
    assert srv.client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0).choices[0].text \
        == ref.text


def test_streaming_equals_the_whole_answer_and_reports_usage(served):
    srv, eng = served
    ref = _reference(eng, PROMPT, 30)
    stream = srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_seeded_sampling_reproduces(served):
    srv, _ = served
    a = srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0.9, seed=5)
    b = srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0.9, seed=5,
                                      stream=True)
    assert a.choices[0].text == "".join(c.choices[0].text for c in b)


def test_stop_strings_cut_the_text(served):
    srv, eng = served
    ref = _reference(eng, PROMPT, 40)
    assert len(ref) > 8
    stop = ref[5:8]  # a string inside the answer: the text ends right before its first occurrence
    want = ref[:ref.find(stop)]
    for stream in (False, True):
        out = srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                            stop=[stop, "\x00never"], stream=stream)
        if stream:
            chunks = list(out)
            text = "".join(c.choices[0].text for c in chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason][0]
        else:
            text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert text == want and finish == "stop"


def test_stop_matcher_holds_back_a_possible_stop_across_pieces():
    m = StopMatcher(["END", "xy"])
    assert m.feed("abc E") == "abc "  # "E" may start "END"
    assert m.feed("N") == ""
    assert m.feed("Dmore") == "" and m.stopped
    m = StopMatcher(["END"])
    assert m.feed("aEN") == "a" and m.feed("x") == "ENx" and m.feed("", final=True) == ""
    assert StopMatcher([]).feed("anything") == "anything"


def test_error_codes(served):
    srv, eng = served
    c = srv.client
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert "does not exist" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="only n = 1"):
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=3.0)
    too_long = [5] * (eng.target.context_len + 1)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=too_long, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="out of range"):
        c.completions.create(model=MODEL, prompt=[10 ** 6], max_tokens=4)
    r = httpx.post(srv.url + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


def test_a_full_queue_answers_429_with_retry_after(llama_target):
    """serving.max_waiting: a request beyond the batch and the queue gets OpenAI's rate-limit error at once, with
    Retry-After, and the queued ones still finish."""
    from tests.test_batch import Collect, held

    cfg = {**_cfg(llama_target), "serving": {"max_batch": 1, "max_waiting": 0}}
    eng = Engine.from_config(cfg)
    srv = Server(create_app(eng, MODEL))
    try:
        first = Collect()
        with held(eng):
            eng.submit([5, 6, 7], first, max_new_tokens=4)  # the batch's one place
            r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert r.json()["error"]["message"].startswith(  # the first still waits: the round lock is held
            "the server is full: 0 requests decoding (serving.max_batch = 1) and 1 waiting for a place "
            "(serving.max_waiting = 0)")
        assert len(first.wait()) == 4
    finally:
        srv.close()


def test_metrics_after_requests(served):
    srv, _ = served
    srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    text = httpx.get(srv.url + "/metrics").text
    for name in ("hetero_spec_requests_total", "hetero_spec_completion_tokens_total", "hetero_spec_prompt_tokens_total",
                 "hetero_spec_request_acceptance_rate_bucket", "hetero_spec_stage_seconds_bucket",
                 "hetero_spec_batch_size_bucket", "hetero_spec_speculation_on", "hetero_spec_draft_restarts",
                 "hetero_spec_dropped_frames_total", "hetero_spec_requests_in_flight"):
        assert name in text, name
    ok = [line for line in text.splitlines()
          if line.startswith('hetero_spec_requests_total{endpoint="completions",status="200"}')]
    assert ok and float(ok[0].split()[-1]) >= 1
    assert 'stage="verify"' in text and 'stage="prefill"' in text


def test_health_in_process(served):
    srv, _ = served
    r = httpx.get(srv.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["draft"] == "in_process"


def test_32_concurrent_streams_lose_nothing(served):
    srv, eng = served
    prompts = [f"{PROMPT} # {i}" for i in range(32)]
    refs = [_reference(eng, p, 12) for p in prompts]

    def one(i: int) -> str:
        stream = srv.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0,
                                               stream=True)
        return "".join(c.choices[0].text for c in stream)

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, range(32)))
    assert got == refs


# -- a client that goes away ---------------------------------------------------------------------------
class SlowEngine:
    """An Engine stand-in whose request yields one chunk, then waits for its cancel event (bounded): the test
    sees whether a disconnect reaches the engine, without depending on how fast anything runs."""

    def __init__(self, real: Engine):
        self.real, self.config, self.target = real, real.config, real.target
        self.cancelled = threading.Event()

    def decode_text(self, ids):
        return self.real.decode_text(ids)

    def submit(self, prompt, sink, stats: Stats, cancel: threading.Event, **kwargs):
        """As the request scheduler does: token chunks to the sink from another thread, then DONE."""
        stats.prompt_tokens = 3

        def run():
            sink([5, 6])
            if cancel.wait(60):
                self.cancelled.set()
                stats.finish_reason = "cancelled"
            else:
                stats.finish_reason = "length"
                sink([7])
            sink(DONE)

        threading.Thread(target=run, daemon=True).start()

    astream_tokens = Engine.astream_tokens  # what the server calls: the real one, over this submit

    def prompt_ids(self, prompt):
        return [1, 2, 3]

    def batch_sizes(self):
        return []

    def waiting_requests(self):
        return 0

    def health(self, timeout_s=None):
        return {"target": "ok", "draft": "none"}

    def close(self):
        pass


def test_a_disconnect_cancels_the_request(served):
    _, eng = served
    slow = SlowEngine(eng)
    srv = Server(create_app(slow, MODEL, own_engine=False))
    try:
        with httpx.Client(timeout=30) as client, client.stream(
                "POST", srv.url + "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # the first chunk arrived; now the client goes away
        assert slow.cancelled.wait(30), "the disconnect never reached the engine"
        text = httpx.get(srv.url + "/metrics").text
        assert "hetero_spec_cancelled_requests_total 1.0" in text
        assert 'hetero_spec_requests_total{endpoint="completions",status="499"} 1.0' in text  # client closed request
    finally:
        srv.close()


# -- chat (chat_target: conftest.py) -------------------------------------------------------------------
def test_chat_completions_render_the_template(chat_target):
    eng = Engine.from_config(_cfg(chat_target))
    srv = Server(create_app(eng, MODEL))
    try:
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f("}]
        out = srv.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
        ref = eng.generate("<system>be brief\n<user>def f(\n<assistant>", max_new_tokens=16, temperature=0.0)
        assert out.choices[0].message.content == ref.text and out.choices[0].message.role == "assistant"
        stream = srv.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                                    stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == ref.text
    finally:
        srv.close()


def test_the_chat_template_is_read_from_chat_template_jinja(llama_target, tmp_path):
    """transformers 5 writes the template to chat_template.jinja (the converted Qwen Instruct checkpoint has no
    chat_template key in tokenizer_config.json): the server must find it there."""
    from hetero_spec.serve.schema import chat_template

    out = tmp_path / "llama-jinja"
    shutil.copytree(llama_target, out)
    assert chat_template(out) is None
    tpl = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (out / "chat_template.jinja").write_text(tpl)
    assert chat_template(out)[0] == tpl
    eng = Engine.from_config(_cfg(out))
    srv = Server(create_app(eng, MODEL))
    try:
        out_msg = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def f("}],
                                                     max_tokens=8, temperature=0)
        assert out_msg.choices[0].message.content == eng.generate("[user] def f(\n", max_new_tokens=8,
                                                                  temperature=0.0).text
    finally:
        srv.close()


def test_serve_prints_where_it_listens_not_a_warning(llama_target, monkeypatch, capsys, caplog):
    import uvicorn

    from hetero_spec.serve import app as app_mod

    ran = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.append(kw))
    with caplog.at_level("WARNING"):
        assert app_mod.serve(_cfg(llama_target), host="127.0.0.1", port=8123, model_name="m") == 0
    assert ran and ran[0]["port"] == 8123
    assert "serving model 'm' on http://127.0.0.1:8123/v1" in capsys.readouterr().err
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "serving" in r.getMessage()]


# -- health with a real worker -------------------------------------------------------------------------
def test_health_fails_when_the_worker_is_killed_or_hung(llama_target, llama_copy_onnx):
    eng = Engine.from_config(_cfg(llama_target, llama_copy_onnx, mode="two_process", pin_cpus=False,
                                  heartbeat_s=1.0, restart_backoff_s=30.0))
    srv = Server(create_app(eng, MODEL, health_timeout_s=1.0))
    try:
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        w = eng.source.sup.current()
        os.kill(w.proc.pid, signal.SIGSTOP)  # hung: alive, but it answers nothing
        try:
            r = httpx.get(srv.url + "/health", timeout=30)
            assert r.status_code == 503 and r.json()["draft"] == "unresponsive"
        finally:
            os.kill(w.proc.pid, signal.SIGCONT)
        os.kill(w.proc.pid, signal.SIGKILL)
        w.proc.wait(30)
        r = httpx.get(srv.url + "/health", timeout=30)
        assert r.status_code == 503 and r.json()["draft"] in ("dead", "restarting")
        # a request still completes (the target alone), identical to a healthy run
        out = srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
        assert out.choices[0].text == Engine.generate(eng, PROMPT, max_new_tokens=16, temperature=0.0).text
    finally:
        srv.close()


def test_serve_cli_help_names_the_endpoints():
    from hetero_spec.cli import build_parser

    helptext = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for word in ("/v1/completions", "/v1/chat/completions", "/health", "/metrics", "127.0.0.1", "--port"):
        assert word in helptext


# -- hostile clients: strict requests, every response counted -------------------------------------------------------
def _post(srv, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


CHAT = "/v1/chat/completions"


def test_unknown_fields_are_a_400_naming_them(served, chat_target):
    srv, _ = served
    base = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for field in ("foo", "temprature", "top_k"):
        err = _error(_post(srv, "/v1/completions", {**base, field: 1}))
        assert err["param"] == field and err["message"].startswith(f"{field}: unknown field")
    err = _error(_post(srv, "/v1/completions", {**base, "stream_options": {"include_usage": True, "x": 1}}))
    assert err["param"] == "stream_options.x"
    # what OpenAI clients send and we accept without acting on (docs/serving.md)
    assert _post(srv, "/v1/completions", {**base, "user": "u-1", "temperature": 0}).status_code == 200
    eng = Engine.from_config(_cfg(chat_target))
    chat = Server(create_app(eng, MODEL))
    try:
        msg = {"role": "user", "content": "hi", "name": "ann"}
        ok = {"model": MODEL, "messages": [msg], "max_tokens": 2, "user": "u", "metadata": {"k": "v"}, "store": False}
        assert _post(chat, CHAT, ok).status_code == 200
        err = _error(_post(chat, CHAT, {**ok, "messages": [{**msg, "mood": "x"}]}))
        assert err["param"] == "messages.0.mood"
        err = _error(_post(chat, CHAT, {**ok, "tools": [{"type": "function", "function": {"name": "f"}}]}))
        assert err["param"] == "tools" and "not supported" in err["message"]
        err = _error(_post(chat, CHAT, {**ok, "response_format": {"type": "json_object"}}))
        assert err["param"] == "response_format"
    finally:
        chat.close()
        eng.close()


def test_values_are_not_coerced_and_errors_say_what_is_wrong(served):
    srv, _ = served
    base = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    err = _error(_post(srv, "/v1/completions", {**base, "max_tokens": "5"}))
    assert err["param"] == "max_tokens" and "integer" in err["message"]
    err = _error(_post(srv, "/v1/completions", {**base, "stream": "yes"}))
    assert err["param"] == "stream"
    err = _error(_post(srv, "/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}'))
    assert err["param"] == "temperature" and err["message"] == "temperature: must be a finite number"
    err = _error(_post(srv, "/v1/completions", b'{"model": "tiny", "prompt": "x",, }'))
    assert err["param"] is None and "not valid JSON" in err["message"] and "at character" in err["message"]
    err = _error(_post(srv, "/v1/completions", [1, 2]))
    assert err["message"] == "the request body must be a JSON object"
    err = _error(_post(srv, "/v1/completions", {**base, "prompt": 5}))
    assert err["param"] == "prompt"  # not pydantic's union tag (prompt.str)


def test_max_tokens_over_the_context_is_a_400_naming_both(served):
    srv, eng = served
    context = eng.target.context_len
    prompt = [5] * (context - 3)
    err = _error(_post(srv, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4}))
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert f"max_tokens is 4, but the prompt has {context - 3} tokens and the context holds {context}" in err["message"]
    assert "at most 3 new tokens fit" in err["message"]
    err = _error(_post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10 ** 9}))
    assert err["code"] == "context_length_exceeded" and str(10 ** 9) in err["message"]
    r = _post(srv, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


def _requests_total(srv) -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith("hetero_spec_requests_total{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1:line.index("}")].split(","))
            out[(labels["endpoint"].strip('"'), labels["status"].strip('"'))] = float(line.split()[-1])
    return out


def test_every_response_is_counted_by_endpoint_and_status(served):
    srv, _ = served
    before = _requests_total(srv)
    sent = {("completions", "400"): 3, ("completions", "404"): 2, ("chat", "400"): 2, ("chat", "404"): 1,
            ("completions", "200"): 1, ("other", "404"): 1}
    for _ in range(3):
        _post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", "foo": 1})
    for _ in range(2):
        _post(srv, "/v1/completions", {"model": "nope", "prompt": "x"})
    for _ in range(2):
        _post(srv, CHAT, b"{not json")
    _post(srv, CHAT, {"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    _post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
    httpx.get(srv.url + "/v1/nothing-here")
    after = _requests_total(srv)
    grown = {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}
    grown.pop(("metrics", "200"), None)  # the scrape before this one
    assert grown == sent


def test_a_stream_whose_response_never_starts_is_cancelled_and_not_left_in_flight(served):
    """The client is gone before the first byte (here: the first send fails): the events generator never runs, so
    its own cleanup cannot; the response's does. The engine hears the cancel, nothing stays in flight, and the
    response is counted as 499."""
    import asyncio

    _, eng = served
    slow = SlowEngine(eng)
    app = create_app(slow, MODEL, own_engine=False)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}

    async def call():
        sent = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if sent:
                return sent.pop()
            await asyncio.sleep(3600)

        async def send(message):
            if message["type"] == "http.response.start":
                raise OSError("the client went away")

        with pytest.raises(OSError):
            await app(scope, receive, send)

    asyncio.run(call())
    assert slow.cancelled.wait(30), "the request was never cancelled"
    metrics = app.state.metrics
    assert metrics.in_flight._value.get() == 0
    assert metrics.requests.labels(endpoint="completions", status="499")._value.get() == 1


# -- limits: slow clients are closed, big bodies refused, connections bounded ----------------------------------------
def _closed_by_server(sock, trickle: bytes | None, bound_s: float = 30.0) -> bytes:
    """Keep the connection busy (one `trickle` line every 0.1 s, if given) until the server closes it; returns what
    it sent. Bounded: a server that never closes fails the test after bound_s."""
    import select

    got, deadline = b"", time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if trickle is not None:
            try:
                sock.sendall(trickle)
            except OSError:  # reset or broken pipe: closed
                return got
        ready, _, _ = select.select([sock], [], [], 0.1)
        if ready:
            try:
                chunk = sock.recv(65536)
            except OSError:
                return got
            if not chunk:
                return got
            got += chunk
    raise AssertionError(f"the server kept the connection open for {bound_s} s (sent {got[:200]!r})")


def test_slow_clients_are_closed_within_the_deadlines_while_a_normal_request_completes(llama_target):
    import socket

    from hetero_spec.serve.limits import uvicorn_options

    cfg = {**_cfg(llama_target), "serving": {"header_timeout_s": 0.5, "body_timeout_s": 0.5, "max_body_bytes": 4096}}
    eng = Engine.from_config(cfg)
    srv = Server(create_app(eng, MODEL), **uvicorn_options(eng.config.serving))
    host, port = srv.url.removeprefix("http://").split(":")
    try:
        trickling = [socket.create_connection((host, int(port))) for _ in range(5)]
        for sock in trickling:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        body = socket.create_connection((host, int(port)))
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        # a normal request is served meanwhile
        r = _post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
        for sock in trickling:
            assert _closed_by_server(sock, trickle=b"X-Slow: 1\r\n") == b""  # headers never done: closed, no reply
        answer = _closed_by_server(body, trickle=None)
        assert answer.startswith(b"HTTP/1.1 408") and b"serving.body_timeout_s" in answer
        big = _post(srv, "/v1/completions", b"{" + b" " * 5000 + b"}")
        assert _error(big, 413)["message"].startswith("the request body is 5002 bytes")
        assert _requests_total(srv)[("completions", "408")] == 1 and _requests_total(srv)[("completions", "413")] == 1
        assert _post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        srv.close()
        eng.close()


def test_connections_beyond_max_connections_are_answered_503(llama_target):
    import socket

    from hetero_spec.serve.limits import uvicorn_options

    eng = Engine.from_config({**_cfg(llama_target), "serving": {"max_connections": 2}})
    srv = Server(create_app(eng, MODEL), **uvicorn_options(eng.config.serving))
    host, port = srv.url.removeprefix("http://").split(":")
    try:
        idle = [socket.create_connection((host, int(port))) for _ in range(2)]
        deadline = time.monotonic() + 30
        while httpx.get(srv.url + "/v1/models", timeout=30).status_code != 503:
            assert time.monotonic() < deadline, "the third connection was never refused"
            time.sleep(0.1)
        for sock in idle:
            sock.close()
        deadline = time.monotonic() + 30
        while httpx.get(srv.url + "/v1/models", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "the server did not take connections again"
            time.sleep(0.1)
    finally:
        srv.close()
        eng.close()
