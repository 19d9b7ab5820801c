"""A ZeroMQ PAIR channel carrying protocol messages. IPC by default; TCP bound to loopback unless
configured otherwise, and then only with CURVE authentication (keys never travel on the wire)."""

from __future__ import annotations

import ipaddress
import logging
import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import zmq

from .protocol import COPY_THRESHOLD, MalformedMessage, decode, encode

log = logging.getLogger(__name__)


@dataclass
class CurveKeys:
    """A CURVE key set for one server/client pair (z85 bytes)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        sp, ss = zmq.curve_keypair()
        cp, cs = zmq.curve_keypair()
        return cls(sp, ss, cp, cs)

    def client_env(self) -> dict[str, str]:
        return {"HETERO_SPEC_CURVE_SERVER": self.server_public.decode(),
                "HETERO_SPEC_CURVE_PUBLIC": self.client_public.decode(),
                "HETERO_SPEC_CURVE_SECRET": self.client_secret.decode()}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Channel:
    """One end of a PAIR socket. recv() drops and counts malformed messages instead of raising."""

    def __init__(self, sock: zmq.Socket, endpoint: str, ipc_path: str | None = None, auth=None):
        self.sock, self.endpoint, self._ipc_path, self._auth = sock, endpoint, ipc_path, auth
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.dropped = 0
        self.sent = 0
        self.received = 0

    @classmethod
    def bind(cls, transport: str = "ipc", host: str = "127.0.0.1", port: int = 0,
             curve: CurveKeys | None = None) -> Channel:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        auth = None
        if curve is not None:
            from zmq.auth.thread import ThreadAuthenticator

            auth = ThreadAuthenticator(ctx)
            auth.start()
            auth.configure_curve_callback(domain="*", credentials_provider=_OnlyKey(curve.client_public))
            sock.curve_secretkey = curve.server_secret
            sock.curve_publickey = curve.server_public
            sock.curve_server = True
        ipc_path = None
        if transport == "ipc":
            ipc_path = os.path.join(tempfile.gettempdir(),
                                    f"hetero-spec-{os.getpid()}-{time.monotonic_ns()}.sock")
            endpoint = f"ipc://{ipc_path}"
            sock.bind(endpoint)
        else:
            if port:
                sock.bind(f"tcp://{host}:{port}")
            else:
                port = sock.bind_to_random_port(f"tcp://{host}")
            endpoint = f"tcp://{host}:{port}"
        return cls(sock, endpoint, ipc_path, auth)

    @classmethod
    def connect(cls, endpoint: str) -> Channel:
        """Worker side. CURVE keys come from the environment when the server requires them."""
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        server_key = os.environ.get("HETERO_SPEC_CURVE_SERVER")
        if server_key:
            sock.curve_serverkey = server_key.encode()
            sock.curve_publickey = os.environ["HETERO_SPEC_CURVE_PUBLIC"].encode()
            sock.curve_secretkey = os.environ["HETERO_SPEC_CURVE_SECRET"].encode()
        sock.connect(endpoint)
        return cls(sock, endpoint)

    def send(self, msg, *arrays: np.ndarray) -> bool:
        """Queue a message without blocking; False when the peer is gone or not keeping up."""
        frames = encode(msg, arrays)
        last = len(frames) - 1
        try:
            for i, frame in enumerate(frames):
                big = isinstance(frame, np.ndarray) and frame.nbytes >= COPY_THRESHOLD
                self.sock.send(frame, flags=(zmq.SNDMORE if i < last else 0) | zmq.NOBLOCK, copy=not big)
        except zmq.Again:
            return False
        self.sent += 1
        return True

    def recv(self, timeout_s: float | None) -> tuple[object, list[np.ndarray]] | None:
        """Next valid message, or None when timeout_s passes first (None timeout = wait forever)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.poller.poll(None if wait is None else int(wait * 1000) if wait >= 0.001 else 0):
                if deadline is None or time.monotonic() >= deadline:
                    return None
                continue
            frames = self.sock.recv_multipart(copy=False)
            try:
                msg, arrays = decode(frames)
            except MalformedMessage as exc:
                self.dropped += 1
                log.warning("dropped a malformed message on %s (%d so far): %s", self.endpoint, self.dropped, exc)
                continue
            self.received += 1
            return msg, arrays

    def close(self) -> None:
        self.sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self._ipc_path and os.path.exists(self._ipc_path):
            os.unlink(self._ipc_path)


class _OnlyKey:
    """ZAP credentials provider that admits exactly one client public key."""

    def __init__(self, key: bytes):
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


def check_bind_host(host: str, curve: bool) -> str | None:
    """None when binding host is allowed; otherwise the reason it is not."""
    if is_loopback(host) or curve:
        return None
    return (f"binding to {host} would listen beyond loopback; enable runtime.curve: true "
            "(ZeroMQ CURVE authentication) first")
