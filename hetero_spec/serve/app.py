"""`hetero-spec serve`: an OpenAI-compatible HTTP server over one Engine (FastAPI + uvicorn; endpoints and
behaviour: docs/serving.md). Each round's tokens reach the event loop through an asyncio queue
(Engine.astream_tokens), so the loop never blocks on decoding; a client that disconnects, or a stop string,
sets the request's cancel event and it leaves the batch before its next round."""

import asyncio
import json
import logging
import re
import secrets
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Detokenizer, Engine
from ..errors import HeteroSpecError, PromptTooLongError, QueueFullError, RequestError
from ..metrics import Stats
from .limits import BodyLimits, uvicorn_options
from .metrics import ServeMetrics
from .schema import ApiError, ChatRequest, CompletionRequest, ErrorBody, StopMatcher, chat_template, render_chat

log = logging.getLogger("hetero_spec.serve")

FINISH = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


#: pydantic's error types -> what the 400 says of the named field
_INVALID = {"extra_forbidden": "unknown field (docs/serving.md lists the fields this server accepts)",
            "finite_number": "must be a finite number", "missing": "required"}


#: the member tags pydantic puts in a union's error path (prompt -> str, list[int]): not field names
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|(list|dict|literal|tuple)\[.*\]|function-.*|[A-Z]\w*)$")


def invalid_request(error: dict[str, Any], content_type: str = "application/json") -> ApiError:
    """The 400 for one of FastAPI's request validation errors: the field's path as `param`, and what is wrong with
    it. Malformed JSON names no field: the position goes in the message."""
    loc = [str(part) for part in error.get("loc", ())[1:] if not _UNION_TAG.match(str(part))]  # after "body"
    if not loc and "json" not in content_type.lower():
        return ApiError(400, f"the request body must be JSON, sent with Content-Type: application/json (not "
                             f"{content_type or 'none'!r})")
    if not loc and error.get("type") == "missing":
        return ApiError(400, "the request body is empty: send a JSON object")
    if error.get("type") == "json_invalid":
        why = (error.get("ctx") or {}).get("error", "invalid JSON")
        where = f" at character {loc[0]}" if loc else ""
        return ApiError(400, f"the request body is not valid JSON: {why}{where}")
    if error.get("type") == "model_attributes_type" and not loc:
        return ApiError(400, "the request body must be a JSON object")
    param = ".".join(loc) or None
    msg = _INVALID.get(error.get("type", ""), error.get("msg", "invalid value"))
    return ApiError(400, f"{param or 'body'}: {msg}", param=param)


#: what the completion endpoints answer (the OpenAPI schema at /openapi.json; tests/test_fuzz.py holds the server to it)
COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "the completion; server-sent events with stream: true"},
    **{status: {"model": ErrorBody, "description": why} for status, why in (
        (400, "an invalid request: the message says what, `param` names the field"),
        (404, "no such model"),
        (408, "the request body did not arrive within serving.body_timeout_s"),
        (413, "the request body is over serving.max_body_bytes"),
        (429, "the batch and the queue are full (Retry-After)"),
        (503, "the engine cannot serve: closed, or failed"))},
}

#: a stream's outcome -> the status it is counted under: its response started as 200, and may end cancelled by the
#: client (nginx's 499, "client closed request") or with an in-band error
STREAM_STATUS = {"ok": "200", "cancelled": "499", "error": "500"}
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/models": "models",
             "/health": "health", "/metrics": "metrics"}


class CountResponses:
    """ASGI middleware: every HTTP response counted in hetero_spec_requests_total by endpoint and status code
    (a path we do not serve is endpoint "other"), errors included, so an operator can alert on error rates. A
    streamed completion counts itself when it ends (STREAM_STATUS); a request that raised before answering is a
    500, and one left without an answer (the client went away first) a 499."""

    def __init__(self, app, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started: list[int] = []

        async def send_counted(message):
            if message["type"] == "http.response.start":
                started.append(message["status"])
            await send(message)

        state = scope.setdefault("state", {})
        unanswered = 499  # nothing answered: the client left first
        try:
            await self.app(scope, receive, send_counted)
        except BaseException as exc:  # one that raised before answering is a 500
            unanswered = 499 if isinstance(exc, asyncio.CancelledError) else 500
            raise
        finally:
            if not state.get("counted_by_stream"):
                endpoint, code = ENDPOINTS.get(scope.get("path", ""), "other"), started[0] if started else unanswered
                self.metrics.requests.labels(endpoint=endpoint, status=str(code)).inc()


class ClosingStream(StreamingResponse):
    """A StreamingResponse that calls on_close when it is over, also when its body never started (the client went
    away first): the body generator's own `finally` runs only once it has started."""

    def __init__(self, content, on_close: Callable[[], None], **options):
        super().__init__(content, **options)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def check_fits(prompt_tokens: int, max_tokens: int | None, context_len: int) -> None:
    """A request's prompt and max_tokens must fit the context, as vLLM answers (the Python API instead stops at the
    context with finish_reason "length"). A prompt that leaves no room at all is the engine's own error."""
    room = context_len - prompt_tokens
    if max_tokens is not None and 0 < room < max_tokens:
        raise ApiError(400, f"max_tokens is {max_tokens}, but the prompt has {prompt_tokens} tokens and the context "
                            f"holds {context_len}: at most {room} new tokens fit; reduce max_tokens or the prompt",
                       param="max_tokens", code="context_length_exceeded")


def _usage(stats: Stats) -> dict[str, int]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


def create_app(engine: Engine, model_name: str, health_timeout_s: float = 5.0, own_engine: bool = True,
               replicas: Callable[[], dict] | None = None):
    """The FastAPI app serving `engine` as model `model_name`. own_engine: close the Engine at shutdown.
    replicas: the deployment's replicas for /health (serve --ray: ray_serve.replica_report)."""
    metrics, created = ServeMetrics(), int(time.time())
    template = chat_template(getattr(engine.target, "model_dir", None) or engine.config.target.model)

    @asynccontextmanager
    async def lifespan(app):
        yield
        if own_engine:
            await asyncio.to_thread(engine.close)

    app = FastAPI(title="hetero_spec", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    serving = engine.config.serving
    app.add_middleware(BodyLimits, max_bytes=serving.max_body_bytes, timeout_s=serving.body_timeout_s)
    app.add_middleware(CountResponses, metrics=metrics)  # added last: the outermost, so it counts 408 and 413 too

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        error = invalid_request(next(iter(exc.errors()), {}), request.headers.get("content-type", ""))
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        """Starlette's and FastAPI's own errors (no such path, a method not allowed, a body that is not text) in
        OpenAI's error body too."""
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        if exc.status_code == 400 and "parsing the body" in str(exc.detail):
            message = "the request body is not valid JSON (not UTF-8 text)"
        return await _api_error(request, ApiError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    def check_model(name: str) -> None:
        if name != model_name:
            raise ApiError(404, f"The model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    async def start(prompt: str | list[int], req, max_tokens: int | None, stats: Stats,
                    cancel: threading.Event) -> AsyncIterator[list[int]]:
        """The request's rounds' token ids (Engine.astream_tokens)."""
        if bad := req.unsupported():
            raise ApiError(400, f"{bad[0]}: {bad[1]}", param=bad[0])
        try:  # validated here, in the caller: a RequestError is a 400 before anything streams
            prompt = engine.prompt_ids(prompt)  # tokenized once, here: its length is checked against the context
            check_fits(len(prompt), max_tokens, engine.target.context_len)
            return await engine.astream_tokens(prompt, stats, cancel, max_new_tokens=max_tokens,
                                               temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                               stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos)
        except PromptTooLongError as exc:
            raise ApiError(400, str(exc), param="prompt", code="context_length_exceeded") from None
        except RequestError as exc:
            raise ApiError(400, str(exc)) from None
        except QueueFullError as exc:
            raise ApiError(429, str(exc), kind="requests", code="rate_limit_exceeded",
                           headers={"Retry-After": str(max(1, round(exc.retry_after_s)))}) from None
        except HeteroSpecError as exc:
            raise ApiError(503, str(exc), kind="server_error") from None

    async def respond(prompt: str | list[int], max_tokens: int | None, req, request: Request, chat: bool):
        stats, cancel = Stats(), threading.Event()
        chunks = await start(prompt, req, max_tokens, stats, cancel)
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        ended: list[str] = []  # done() ran (once)
        flying: list[bool] = []  # counted in requests_in_flight

        def fly() -> None:
            flying.append(True)
            metrics.in_flight.inc()

        async def pieces() -> AsyncIterator[str]:
            """Text pieces, cut at the first stop string (which then ends the request)."""
            matcher = StopMatcher(req.stop_strings())
            async for text in Detokenizer(engine.decode_text).apieces(chunks):
                if piece := matcher.feed(text):
                    yield piece
                if matcher.stopped:
                    cancel.set()  # the engine stops before its next round
                    stats.finish_reason = "stop"
                    break
            if rest := matcher.feed("", final=True):
                yield rest

        def choice(text: str | None, final: bool = False) -> dict[str, Any]:
            """A stream's delta, or the whole answer's message; the last carries the finish reason."""
            finish = FINISH.get(stats.finish_reason, "stop") if final else None
            if chat:
                body = {"delta": {"content": text} if text is not None else {}} if req.stream else \
                    {"message": {"role": "assistant", "content": text}}
                return {"index": 0, **body, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        def body(choices: list, **more) -> dict[str, Any]:
            obj = ("chat.completion.chunk" if req.stream else "chat.completion") if chat else "text_completion"
            return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": choices,
                    **more}

        def done(status: str) -> None:
            cancel.set()  # a disconnect (or anything else) ends the request before its next round
            if ended:
                return
            ended.append(status)
            if flying:
                metrics.in_flight.dec()
            if req.stream:  # a stream's outcome is known only at its end (CountResponses counts the rest)
                metrics.requests.labels(endpoint="chat" if chat else "completions", status=STREAM_STATUS[status]).inc()
            if status == "cancelled":
                metrics.cancelled.inc()
            metrics.observe(stats)

        if not req.stream:
            fly()
            try:
                text = "".join([p async for p in pieces()])
            except BaseException:
                done("error")
                raise
            done("ok")
            return JSONResponse(body([choice(text, final=True)], usage=_usage(stats)))
        request.state.counted_by_stream = True

        def event(data: dict[str, Any]) -> str:
            return f"data: {json.dumps(data)}\n\n"

        async def events() -> AsyncIterator[str]:
            status = "cancelled"
            fly()  # from the first event on: a response that never starts is never in flight
            try:
                if chat:
                    yield event(body([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "finish_reason": None}]))
                async for piece in pieces():
                    if await request.is_disconnected():
                        return
                    yield event(body([choice(piece)]))
                yield event(body([choice(None if chat else "", final=True)]))
                if req.stream_options and req.stream_options.include_usage:
                    yield event(body([], usage=_usage(stats)))
                yield "data: [DONE]\n\n"
                status = "ok"
            except Exception as exc:  # the stream has started: report in-band, as OpenAI does
                status = "error"
                log.exception("request %s failed", rid)
                yield event(ApiError(500, f"generation failed: {exc}", kind="server_error").body())
            finally:
                done(status)

        # the response is over, whether or not its events ever ran
        return ClosingStream(events(), lambda: done("cancelled"), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions", responses=COMPLETION_RESPONSES)
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        return await respond(req.prompt_value(), req.max_tokens or 16, req, request, chat=False)

    @app.post("/v1/chat/completions", responses=COMPLETION_RESPONSES)
    async def chat_completions(req: ChatRequest, request: Request):
        check_model(req.model)
        if template is None:
            raise ApiError(400, f"model {model_name!r} has no chat template (tokenizer_config.json chat_template or "
                                "chat_template.jinja); use /v1/completions", param="messages", code="no_chat_template")
        try:
            prompt = render_chat(template, req.messages)
        except Exception as exc:  # a template that refuses the conversation (raise_exception) or fails
            raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from None
        return await respond(prompt, req.limit(), req, request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "hetero_spec"}]}

    @app.get("/health", responses={503: {"description": "the target stalled, or the draft worker is down or hung"}})
    async def health():
        """Probes the target (a one-token forward) and the draft worker (a ping) when idle; while a request
        runs, the request loop's last round and the worker's last message. 503 when either is not ok."""
        try:
            report = await asyncio.wait_for(asyncio.to_thread(engine.health, health_timeout_s), health_timeout_s + 1.0)
        except (TimeoutError, HeteroSpecError) as exc:
            why = f"no answer within {health_timeout_s} s" if isinstance(exc, TimeoutError) else str(exc)
            return JSONResponse({"status": "unhealthy", "reason": why}, status_code=503)
        metrics.draft_restarts.set(report.get("draft_restarts", 0))
        healthy = report.get("target") == "ok" and report.get("draft") in ("ok", "in_process", "none")
        if replicas is not None:  # this replica's health stands; whether every replica is up is said beside it
            try:
                report["replicas"] = await asyncio.wait_for(asyncio.to_thread(replicas), health_timeout_s)
            except Exception as exc:  # noqa: BLE001 - Serve's controller did not answer: say so, stay healthy
                report["replicas"] = {"all_ready": False, "reason": f"{type(exc).__name__}: {exc}"}
        return JSONResponse({"status": "ok" if healthy else "unhealthy", **report}, status_code=200 if healthy else 503)

    @app.get("/metrics", responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def prometheus():
        metrics.scrape(engine)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def serve(config, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          overrides: dict | None = None, log_level: str = "info") -> int:
    """Load the Engine and serve it until SIGINT/SIGTERM (in-flight requests finish or are cancelled)."""
    import uvicorn
    engine = Engine.from_config(config, overrides=overrides)
    name = model_name or engine.config.target.model.name
    app = create_app(engine, name)
    # a plain line, whatever the log level: where to reach the server is not a warning, and not hidden either
    print(f"hetero-spec: serving model {name!r} on http://{host}:{port}/v1 (OpenAI-compatible)", file=sys.stderr,
          flush=True)
    # uvicorn drains on SIGTERM, then raises the signal again for the handler it found: ignored here, so a drained
    # server exits 0 (the CLI's own handler would make it 143)
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30,
                    **uvicorn_options(engine.config.serving))
    finally:
        if main:
            signal.signal(signal.SIGTERM, before)
    return 0
