"""What bounds a client of `hetero-spec serve` (serving.* in the config; docs/serving.md, "Limits"): a deadline for
a request's headers (uvicorn has none: a protocol subclass adds it), a deadline and a size limit for its body (an
ASGI middleware), and uvicorn's own connection limit and keep-alive timeout."""

import asyncio
from typing import Any

from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from .schema import ApiError


def with_header_deadline(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection that has not sent a request's headers within timeout_s of
    opening or of its previous response (a client that trickles header lines holds nothing for long)."""

    class HeaderDeadline(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()  # armed for this cycle: a new request replaces it once its headers are parsed
            self._header_timer = self.loop.call_later(timeout_s, self._headers_late, self.cycle)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()  # a no-op on a timer that already fired

        def _headers_late(self, armed_for) -> None:
            if self.cycle is armed_for and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


class BodyLimits:
    """ASGI middleware: reads the request body before the app does, under a deadline and a size limit. A body
    larger than max_bytes is answered 413 (at once when its Content-Length says so); one that has not fully arrived
    within timeout_s is answered 408; either way the connection closes. The app then reads the body from memory
    (requests are small JSON), and later reads (a stream's disconnect watch) go to the connection as before."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await _refuse(scope, receive, send, 413, f"the request body is {int(length)} bytes; this server "
                                                            f"takes at most {self.max_bytes} (serving.max_body_bytes)")
        loop = asyncio.get_running_loop()
        deadline, body = loop.time() + self.timeout_s, bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return await _refuse(scope, receive, send, 408, "the request body did not arrive within "
                                                                f"{self.timeout_s:g} s (serving.body_timeout_s)")
            if message["type"] != "http.request":
                return  # the client left before its body was in: nobody to answer
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await _refuse(scope, receive, send, 413, f"the request body is over {self.max_bytes} bytes "
                                                                "(serving.max_body_bytes)")
            if not message.get("more_body", False):
                break
        unread = [{"type": "http.request", "body": bytes(body), "more_body": False}]

        async def replay():
            return unread.pop() if unread else await receive()

        await self.app(scope, replay, send)


async def _refuse(scope, receive, send, status: int, message: str) -> None:
    """OpenAI's error body, and the connection closed after it."""
    await JSONResponse(ApiError(status, message).body(), status, {"connection": "close"})(scope, receive, send)


def uvicorn_options(serving) -> dict[str, Any]:
    """uvicorn.Config's settings for the serving section: the header deadline, the connection limit, keep-alive."""
    return {"http": with_header_deadline(serving.header_timeout_s), "limit_concurrency": serving.max_connections,
            "timeout_keep_alive": serving.keep_alive_s}
