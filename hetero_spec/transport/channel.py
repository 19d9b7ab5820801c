"""ZeroMQ PAIR channels carrying protocol messages: IPC by default, every TCP link authenticated with ZeroMQ CURVE
(keys never travel on the wire). Each engine owns one `ServerContext` (docs/security.md, docs/architecture.md)."""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from .protocol import COPY_THRESHOLD, MalformedMessage, decode, encode

log = logging.getLogger(__name__)

DEFAULT_MAX_MSG_BYTES = 256 << 20  # per frame; the runtime sets a bound from the vocabulary and context
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
#: monitor events -> link_events() names; any other event watched is "handshake_failed"
_LINK_EVENTS = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "connected", zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused"}


@dataclass
class CurveKeys:
    """A CURVE key set for one server/client pair (z85 bytes)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        return cls(*zmq.curve_keypair(), *zmq.curve_keypair())

    @classmethod
    def load(cls, directory: str | Path) -> CurveKeys:
        """Read `server.key_secret` and `client.key_secret` (ZeroMQ certificates, as `hetero-spec keys` writes them)."""
        directory = Path(directory)
        server_public, server_secret = zmq.auth.load_certificate(directory / "server.key_secret")
        client_public, client_secret = zmq.auth.load_certificate(directory / "client.key_secret")
        if not server_secret or not client_secret:
            raise ValueError(f"{directory}: server.key_secret and client.key_secret must hold secret keys")
        return cls(server_public, server_secret, client_public, client_secret)

    def client_handover(self) -> bytes:
        """What the worker needs, as one line for its stdin (a pipe only it can read; never argv/env)."""
        return (json.dumps({"server_public": self.server_public.decode(), "public": self.client_public.decode(),
                            "secret": self.client_secret.decode()}) + "\n").encode()


def write_keys(directory: str | Path) -> Path:
    """Create `server.key_secret`/`client.key_secret` (+ public halves) in a new mode-0700 directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    zmq.auth.create_certificates(str(directory), "server")
    zmq.auth.create_certificates(str(directory), "client")
    for secret_file in directory.glob("*.key_secret"):
        os.chmod(secret_file, 0o600)
    return directory


def worker_keys(directory: str | Path) -> dict:
    """A remote worker's keys, from a `hetero-spec keys` directory: its client.key_secret, the target's server.key."""
    directory = Path(directory)
    try:
        public, secret = zmq.auth.load_certificate(directory / "client.key_secret")
        server_public, _ = zmq.auth.load_certificate(directory / "server.key")
    except (OSError, ValueError) as exc:
        raise ValueError(f"--keys {str(directory)!r}: needs client.key_secret and server.key ({exc})") from None
    return {"server_public": server_public.decode(), "public": public.decode(), "secret": secret.decode()}


def admitted_keys(curve_keys: Path, worker_keys_dir: Path | None) -> tuple[CurveKeys, list[bytes]]:
    """A target's side of a link to remote workers: its own server key pair (curve_keys/server.key_secret) and
    the client public keys it admits (every *.key in worker_keys_dir; default curve_keys/client.key)."""
    server_public, server_secret = zmq.auth.load_certificate(Path(curve_keys) / "server.key_secret")
    files = sorted(Path(worker_keys_dir).glob("*.key")) if worker_keys_dir else [Path(curve_keys) / "client.key"]
    clients = [zmq.auth.load_certificate(f)[0] for f in files]
    if not clients:
        raise ValueError(f"{worker_keys_dir}: no *.key files (client public keys) to admit")
    return CurveKeys(server_public, server_secret, clients[0], b""), clients


def check_bind_host(host: str, keys_configured: bool) -> str | None:
    """None when binding `host` is allowed; otherwise the reason it is not. Every TCP link uses CURVE;
    beyond loopback the keys must be configured (runtime.curve_keys), not generated per worker."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback or keys_configured:
        return None
    return (f"binding to {host} would listen beyond loopback; configure runtime.curve_keys (a directory "
            "with server.key_secret and client.key_secret, made by `hetero-spec keys --out DIR`) first")


def _task_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _pair(ctx: zmq.Context, max_msg_bytes: int) -> zmq.Socket:
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    sock.copy_threshold = COPY_THRESHOLD  # send(copy=False) copies smaller frames (faster below tens of kB)
    return sock


def key_fingerprint(public_key: bytes | str) -> str:
    """A short name for a CURVE public key (z85), for logs on both ends: the first 16 hex digits of its SHA-256.
    `hetero-spec keys` prints it for each key it writes."""
    return hashlib.sha256(zmq.utils.z85.decode(public_key)).hexdigest()[:16]


class ServerContext:
    """One engine's ZeroMQ context (its own I/O thread, which the runtime pins), at most one ZAP authenticator
    admitting a *set* of client keys (ZeroMQ allows one per context: it binds inproc://zeromq.zap.01), and a private
    directory (mode 0700) for IPC sockets and worker logs. `close()` ends all of it, so two engines in one process
    never share an address or a file, and closing then re-binding at once cannot collide."""

    def __init__(self):
        before = _task_ids()
        self.ctx = zmq.Context()
        self.ctx.socket(zmq.PAIR).close(linger=0)  # a first socket starts the context's threads now, to be pinned
        #: this context's own threads (I/O and reaper): pin these, not other engines' ones
        self.thread_ids = sorted(_task_ids() - before)
        self.dir = tempfile.mkdtemp(prefix="hetero-spec-")  # mode 0700: other users cannot reach the sockets
        self._auth, self._lock, self.closed = None, threading.Lock(), False
        # the client public keys admitted, under a lock of their own: close() stops the authenticator's thread,
        # which may be in callback(), while holding _lock
        self._keys: set[bytes] = set()
        self._keys_lock = threading.Lock()
        self._refused: set[bytes] = set()  # keys logged as refused (once each: a refused worker retries often)

    def callback(self, domain: str, key: bytes) -> bool:
        """The authenticator's credentials provider: whether a client key is admitted (a refusal is logged)."""
        with self._keys_lock:
            admitted = key in self._keys
            first = not admitted and key not in self._refused
            if first:
                self._refused.add(key)
        if first:
            log.warning("CURVE: refused a draft worker whose key (fingerprint %s) is not admitted "
                        "(runtime.worker_keys)", key_fingerprint(key))
        return admitted

    def admit(self, client_public: bytes) -> None:
        """Start the authenticator on first use; admit one more client key."""
        with self._lock:
            if self._auth is None:
                from zmq.auth.thread import ThreadAuthenticator
                self._auth = ThreadAuthenticator(self.ctx)
                self._auth.start()
                self._auth.configure_curve_callback(domain="*", credentials_provider=self)
        with self._keys_lock:
            self._keys.add(client_public)

    def revoke(self, client_public: bytes) -> None:
        with self._keys_lock:
            self._keys.discard(client_public)

    def close(self) -> None:
        """Stop the authenticator, close every socket, terminate the context, remove the directory."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self._auth is not None:
                self._auth.stop()
                self._auth = None
            self.ctx.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)


class Channel:
    """One end of a PAIR socket. recv() drops and counts malformed messages instead of raising; after
    close() (or once the peer was reaped) send() returns False and recv() None, never a ZMQError."""

    def __init__(self, sock: zmq.Socket, endpoint: str, ipc_path: str | None = None, own_ctx=None,
                 client_key: bytes | None = None, server: ServerContext | None = None):
        self.sock, self.endpoint, self._ipc_path, self._own_ctx = sock, endpoint, ipc_path, own_ctx
        self._client_key, self._server = client_key, server
        self.dropped = self.received = 0
        self.closed, self._monitor = False, None

    @classmethod
    def bind(cls, server: ServerContext, transport: str = "ipc", host: str = "127.0.0.1", port: int = 0,
             curve: CurveKeys | None = None, name: str = "worker",
             max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES, watch: bool = False) -> Channel:
        """Target side. TCP requires `curve` (every TCP link is authenticated); IPC may use it too. watch: report
        failed handshakes (link_events), for a target that waits for workers it did not start."""
        if transport == "tcp" and curve is None:
            raise ValueError("a TCP channel needs CURVE keys")
        sock = _pair(server.ctx, max_msg_bytes)
        if curve is not None:
            server.admit(curve.client_public)
            sock.curve_secretkey, sock.curve_publickey = curve.server_secret, curve.server_public
            sock.curve_server = True
        ipc_path = os.path.join(server.dir, f"{name}.sock") if transport == "ipc" else None
        channel = cls(sock, f"ipc://{ipc_path}" if ipc_path else f"tcp://{host}:{port}", ipc_path,
                      client_key=curve.client_public if curve else None, server=server)
        try:
            if ipc_path or port:
                sock.bind(channel.endpoint)
            else:
                channel.endpoint = f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"
        except zmq.ZMQError:
            channel.close()  # the socket, and the client key admitted for it
            raise
        if watch:
            channel._monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
        return channel

    @classmethod
    def connect(cls, endpoint: str, curve: dict | None = None, max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES,
                watch: bool = False) -> Channel:
        """Worker side, with its own context. `curve`: {"server_public", "public", "secret"} (z85 str).
        watch: report the link's handshakes (link_events), for a worker that outlives its targets."""
        ctx = zmq.Context()
        sock = _pair(ctx, max_msg_bytes)
        if curve:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
                curve["server_public"].encode(), curve["public"].encode(), curve["secret"].encode())
        channel = cls(sock, endpoint, own_ctx=ctx)
        if watch:
            channel._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH |
                                                       _HANDSHAKE_FAILED)
        sock.connect(endpoint)
        return channel

    def link_events(self) -> list[str]:
        """What the link did since the last call (watch only): `connected` per handshake, `refused` when the
        peer turned this end's CURVE key down (ZAP), `handshake_failed` when the handshake broke off (keys that do
        not belong together: a client without the server's public key, a peer without CURVE)."""
        out = []
        while self._monitor is not None and not self.closed and self._monitor.poll(0):
            out.append(_LINK_EVENTS.get(recv_monitor_message(self._monitor)["event"], "handshake_failed"))
        return out

    def send(self, msg, *arrays: np.ndarray) -> bool:
        """Queue a message without blocking; False when closed, or the peer is gone or not keeping up."""
        if self.closed:
            return False
        try:
            self.sock.send_multipart(encode(msg, arrays), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # Again: the peer is not keeping up; else the socket went away (a reap)
            log.debug("send on %s failed: %s", self.endpoint, exc)
            return False
        return True

    def poll(self) -> bool:
        """Whether a message is waiting (never blocks)."""
        try:
            return not self.closed and bool(self.sock.poll(0))
        except zmq.ZMQError:
            return False

    def recv(self, timeout_s: float | None) -> tuple[object, list[np.ndarray]] | None:
        """Next valid message, or None when timeout_s passes first (None timeout = wait forever)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.closed:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            try:
                if not self.sock.poll(wait_ms, zmq.POLLIN):
                    if deadline is None or time.monotonic() >= deadline:
                        return None
                    continue
                frames = self.sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                log.debug("recv on %s failed: %s", self.endpoint, exc)
                return None
            if (got := self.accept(frames)) is not None:
                return got
        return None

    def accept(self, frames: list) -> tuple[object, list[np.ndarray]] | None:
        """Decode one received message; None (dropped and counted) when it is malformed."""
        try:
            msg, arrays = decode(frames)
        except MalformedMessage as exc:
            self.reject(str(exc))
            return None
        self.received += 1
        return msg, arrays

    def reject(self, why: str) -> None:
        """Count (and log) a dropped message: malformed on the wire, or refused by the receiver."""
        self.dropped += 1
        log.warning("dropped a message on %s (%d so far): %s", self.endpoint, self.dropped, why)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(zmq.ZMQError):
            if self._monitor is not None:
                self.sock.disable_monitor()
                self._monitor.close(linger=0)
            self.sock.close(linger=0)
        if self._server is not None and self._client_key is not None:
            self._server.revoke(self._client_key)
        if self._own_ctx is not None:
            self._own_ctx.destroy(linger=0)
        if self._ipc_path and os.path.exists(self._ipc_path):
            os.unlink(self._ipc_path)
