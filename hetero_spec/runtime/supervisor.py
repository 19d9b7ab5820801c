"""Target-side handle of the draft worker: spawn, readiness (its Ready), health (its process runs and it answers
Ping within the heartbeat), restart with backoff in a background thread, shutdown (docs/features-two-process.md)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import HeteroSpecError
from ..transport.channel import (DEFAULT_MAX_MSG_BYTES, Channel, CurveKeys, ServerContext, admitted_keys,
                                 check_bind_host, key_fingerprint)
from ..transport.protocol import Failure, Ping, Pong, Ready, Shutdown

if TYPE_CHECKING:
    from ..config import DraftConfig, RuntimeConfig

log = logging.getLogger(__name__)


class WorkerStartError(HeteroSpecError):
    """The draft worker did not become ready."""


@dataclass
class WorkerSpec:
    """Everything needed to start a draft worker: the config's runtime and draft sections (transport, CURVE,
    timeouts; the model), and what the engine derives from them."""

    runtime: RuntimeConfig
    draft: DraftConfig
    vocab_width: int
    cpus: list[int] | None = None
    max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES
    max_streams: int = 64  # requests the worker drafts for at once (serving.max_batch and some)
    prompt_window: int | None = None  # draft.prompt_window, as resolved for this layout
    max_backoff_s: float = 30.0


@dataclass
class Worker:
    """One incarnation of the worker process and its channel."""

    proc: subprocess.Popen
    channel: Channel
    generation: int
    last_heard: float = field(default_factory=time.monotonic)
    ping_sent: float | None = None
    stderr_path: str = ""
    failed: bool = False  # fail() handled it (set under the supervisor's lock)
    server_fingerprint: str = ""  # a remote worker's link: the target's CURVE server key, for the logs
    handshake_logged: bool = False
    ready: Ready | None = None  # what it said when ready (the provider it drafts on, a fallback taken)

    def provider(self) -> dict:
        """The execution provider the worker's draft runs on, and the fallbacks its config allowed and took."""
        if self.ready is None:
            return {}
        fallback = {"draft_fallback": self.ready.fallback} if self.ready.fallback else {}
        return {"draft_provider": self.ready.providers[0], **fallback} if self.ready.providers else fallback


class RemoteProcess:
    """Stands in for the Popen of a worker on another host: it runs as long as the link says so (heartbeat)."""

    returncode = None
    pid = 0  # the remote pid, once its Ready arrives

    def poll(self, timeout=None):
        """Still running (None). It is terminate, kill and wait too: a remote process is not ours to end."""
        return None

    terminate = kill = wait = poll


class DraftSupervisor:
    """Owns the current worker. Only the thread serving a request talks on the channel; the restart thread only
    spawns a new worker and hands it over once it is ready. `launcher` and `clock` are seams for tests."""

    def __init__(self, spec: WorkerSpec, launcher=None, clock=time.monotonic):
        self.spec, self.clock = spec, clock
        runtime = spec.runtime
        if runtime.transport == "tcp" and (why := check_bind_host(runtime.host, runtime.curve_keys is not None)):
            raise WorkerStartError(why)
        self._server = ServerContext() if launcher is None else None
        self.remote = runtime.worker == "remote"
        self.launcher = launcher or self
        self._lock, self._closing = threading.Lock(), threading.Event()
        self._worker: Worker | None = None
        self._pending: Worker | None = None  # a restarted worker, adopted by current()
        self._restart_thread: threading.Thread | None = None
        self.generation = self.restarts = self.failures = 0
        self._consecutive = 0  # failures since a worker was last heard from (the restart backoff)
        self.last_failure = ""

    def launch(self, spec: WorkerSpec, generation: int) -> Worker:
        """The default launcher (`launcher` replaces it in tests): a process of ours, or a remote worker's link."""
        return (self._launch_remote if self.remote else self._launch_process)(spec, generation)

    def _launch_process(self, spec: WorkerSpec, generation: int) -> Worker:
        """`python -m hetero_spec.runtime.draft_worker` on a fresh channel of the engine's context. CURVE
        keys (ephemeral per worker unless configured) go to the worker through its stdin pipe."""
        runtime, draft = spec.runtime, spec.draft
        curve = None
        if runtime.transport == "tcp" or runtime.curve:  # CURVE keys: configured (required beyond loopback), or new
            curve = CurveKeys.load(runtime.curve_keys) if runtime.curve_keys else CurveKeys.generate()
        channel = Channel.bind(self._server, runtime.transport, runtime.host, runtime.port, curve,
                               name=f"worker-{generation}", max_msg_bytes=spec.max_msg_bytes)
        cmd = [sys.executable, "-m", "hetero_spec.runtime.draft_worker", "--endpoint", channel.endpoint,
               "--model", str(draft.model), "--threads", str(draft.threads),
               "--providers", json.dumps([p if isinstance(p, str) else p.model_dump() for p in draft.providers]),
               "--vocab-width", str(spec.vocab_width), "--parent-pid", str(os.getpid()),
               "--max-msg-bytes", str(spec.max_msg_bytes), "--max-streams", str(spec.max_streams),
               "--prompt-window", str(spec.prompt_window or 0), "--cpus", ",".join(map(str, spec.cpus or [])),
               "--kernels", runtime.kernels,
               *(["--keys-stdin"] if curve is not None else [])]
        err_path = os.path.join(self._server.dir, f"worker-{generation}.log")
        try:
            with open(err_path, "wb") as err:
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if curve else subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=err)
            if curve is not None:
                with contextlib.suppress(OSError):  # it died at once; readiness reports why
                    proc.stdin.write(curve.client_handover())
                    proc.stdin.close()
        except BaseException:
            channel.close()
            raise
        return Worker(proc=proc, channel=channel, generation=generation, stderr_path=err_path)

    def _launch_remote(self, spec: WorkerSpec, generation: int) -> Worker:
        """runtime.worker remote: bind runtime.host:runtime.port over TCP with the target's CURVE key, admit
        the keys of runtime.worker_keys, and wait there for a worker started elsewhere (`hetero-spec draft-worker
        --connect`)."""
        runtime = spec.runtime
        curve, clients = admitted_keys(runtime.curve_keys, runtime.worker_keys)
        channel = Channel.bind(self._server, "tcp", runtime.host, runtime.port, curve, name=f"worker-{generation}",
                               max_msg_bytes=spec.max_msg_bytes, watch=True)
        for key in clients[1:]:
            self._server.admit(key)
        return Worker(proc=RemoteProcess(), channel=channel, generation=generation,
                      server_fingerprint=key_fingerprint(curve.server_public))

    @property
    def thread_ids(self) -> list[int]:
        """The ZeroMQ threads of this supervisor's own context (to pin them)."""
        return self._server.thread_ids if self._server is not None else []

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the first worker and wait until it is ready; raises WorkerStartError naming the cause."""
        try:
            self._worker = self._spawn_ready()
        except BaseException as exc:
            if not isinstance(exc, WorkerStartError) or not self.remote or self._closing.is_set():
                self.close()
                raise
            # a remote worker may come later: decode alone meanwhile, and keep the port open for it
            log.warning("%s; the target decodes alone until a worker connects", exc)
            self.last_failure = str(exc)
            self._restart_thread = threading.Thread(target=self._restart_loop, name="draft-restart", daemon=True)
            self._restart_thread.start()

    def _spawn_ready(self) -> Worker:
        with self._lock:
            self.generation += 1
            generation = self.generation
        worker = self.launcher.launch(self.spec, generation)
        if why := self._await_ready(worker):
            self._reap(worker)
            raise WorkerStartError(why)
        worker.last_heard = self.clock()
        return worker

    def _await_ready(self, worker: Worker) -> str:
        """"" once worker has said Ready with a vocabulary and context that fit; otherwise why it has not."""
        model, timeout_s = self.spec.draft.model, self.spec.runtime.ready_timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._closing.is_set():
            if self.remote and not worker.handshake_logged and "handshake_failed" in worker.channel.link_events():
                worker.handshake_logged = True  # once per wait: a worker with the wrong keys retries every 0.1 s
                log.warning("a draft worker at %s failed the CURVE handshake: it does not hold this target's server "
                            "key (runtime.curve_keys server.key, fingerprint %s)", worker.channel.endpoint,
                            worker.server_fingerprint)
            msg = (worker.channel.recv(0.1) or (None,))[0]
            if isinstance(msg, Ready):
                worker.ready = msg
                if isinstance(worker.proc, RemoteProcess):
                    worker.proc.pid = msg.pid
                if msg.vocab_width != self.spec.vocab_width:
                    return (f"draft worker {model}: it reports a vocabulary width of {msg.vocab_width}, the "
                            f"target's is {self.spec.vocab_width}" + (
                                f" (start it with --vocab-width {self.spec.vocab_width})" if self.remote else ""))
                if msg.context_len < 2:
                    return f"draft worker {model}: it reports a context length of {msg.context_len}"
                return ""
            if isinstance(msg, Failure):
                return f"draft worker failed to load {model}: {msg.error}"
            if worker.proc.poll() is not None:
                tail = "(no output)"
                with contextlib.suppress(OSError):
                    tail = Path(worker.stderr_path).read_text(errors="replace")[-1500:].strip() or tail
                return f"draft worker exited with code {worker.proc.returncode} before it was ready ({model}): {tail}"
        if self._closing.is_set():
            return "the engine is closing"
        if self.remote:
            return (f"no draft worker connected to {worker.channel.endpoint} within {timeout_s:.0f} s "
                    "(runtime.ready_timeout_s)")
        return f"draft worker did not become ready within {timeout_s:.0f} s (runtime.ready_timeout_s); model {model}"

    def _reap(self, worker: Worker, graceful: bool = False) -> None:
        if graceful and worker.proc.poll() is None:
            with contextlib.suppress(Exception):  # escalate below
                worker.channel.send(Shutdown())
                worker.proc.wait(timeout=2.0)
        if worker.proc.poll() is None:
            worker.proc.terminate()
            try:
                worker.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()
        worker.channel.close()
        with contextlib.suppress(OSError):  # a remote worker has no log here: its stderr_path is ""
            os.unlink(worker.stderr_path)

    def close(self) -> None:
        """Shut every worker down cleanly (Shutdown, then SIGTERM, then SIGKILL); no orphans. Then end
        the engine's ZeroMQ context and remove its private directory (sockets, logs)."""
        self._closing.set()
        thread = self._restart_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.spec.runtime.ready_timeout_s + 5)
        with self._lock:
            workers = [w for w in (self._worker, self._pending) if w is not None]
            self._worker = self._pending = None
        for worker in workers:
            self._reap(worker, graceful=True)
        if self._server is not None:
            self._server.close()

    # -- health -------------------------------------------------------------------------------------
    def current(self) -> Worker | None:
        """The usable worker, adopting a freshly restarted one; None while there is none."""
        with self._lock:
            if self._pending is not None:
                self._worker, self._pending = self._pending, None
            return self._worker

    def check(self, worker: Worker) -> bool:
        """Liveness probe of the current worker; on death or hang, start a restart and return False."""
        if worker.channel.closed:  # reaped already (a failure seen elsewhere)
            return False
        now, heartbeat_s = self.clock(), self.spec.runtime.heartbeat_s
        reason = ""
        if worker.proc.poll() is not None:
            reason = f"exited with code {worker.proc.returncode}"
        elif worker.ping_sent is not None and now - worker.ping_sent > heartbeat_s:
            reason = f"no answer to a ping within {heartbeat_s:.1f} s (hung)"
        elif worker.ping_sent is None and now - worker.last_heard > heartbeat_s:
            worker.ping_sent = now
            if not worker.channel.send(Ping(seq=worker.generation, sent=now)):
                reason = "not accepting messages"
        if reason:
            self.fail(worker, reason)
        return not reason

    def heard(self, worker: Worker, msg) -> None:
        worker.last_heard = self.clock()
        self._consecutive = 0
        if isinstance(msg, Pong):
            worker.ping_sent = None

    def fail(self, worker: Worker, reason: str) -> None:
        """Declare `worker` dead: reap it (idempotent) and restart in the background."""
        with self._lock:  # check and act at once: two threads that see one death count it, and restart, once
            if worker.failed or (worker.channel.closed and self._worker is not worker):
                return  # already handled
            worker.failed = True
            if self._worker is worker:
                self._worker = None
            self.failures += 1
            self._consecutive += 1
            self.last_failure = reason
            if not self._closing.is_set() and self._restart_thread is None:
                self._restart_thread = threading.Thread(target=self._restart_loop, name="draft-restart", daemon=True)
                self._restart_thread.start()
        log.warning("draft worker (pid %d) %s; the target continues alone and the worker is restarted",
                    worker.proc.pid, reason)
        self._reap(worker)

    def _restart_loop(self) -> None:
        """Spawn workers, with backoff, until one is ready (handed over as _pending) or the engine closes."""
        spec = self.spec
        backoff = min(spec.runtime.restart_backoff_s * 2 ** min(max(self._consecutive, 1) - 1, 10), spec.max_backoff_s)
        try:
            while not self._closing.wait(backoff):
                try:
                    worker = self._spawn_ready()
                except Exception as exc:  # noqa: BLE001 - a WorkerStartError, or e.g. the context closed under us
                    if self._closing.is_set():
                        return
                    log.warning("draft worker restart failed: %s", exc)
                    if not self.remote:  # a remote worker is not ours to start: keep the port open for it
                        backoff = min(backoff * 2, spec.max_backoff_s)
                    continue
                with self._lock:
                    if not self._closing.is_set():
                        self._pending = worker
                        self.restarts += 1
                        self._restart_thread = None  # with the hand-over: a failure of it from now on restarts again
                        log.info("draft worker restarted (pid %d)", worker.proc.pid)
                        return
                self._reap(worker, graceful=True)
                return
        finally:
            with self._lock:  # the next failure starts a new restart thread (fail() reads this under the lock)
                if self._restart_thread is threading.current_thread():
                    self._restart_thread = None

    def _counts(self) -> dict:
        """What every health report ends with: the last failure, restarts and failures so far."""
        return {"last_failure": self.last_failure, "draft_restarts": self.restarts, "draft_failures": self.failures}

    def _down(self, worker: Worker | None) -> dict | None:
        """The state without a running worker (none, or its process has exited); None while it runs."""
        if worker is None:
            return {"draft": "closed" if self._closing.is_set() else "restarting", **self._counts()}
        if worker.proc.poll() is not None:
            return {"draft": "dead", "exit_code": worker.proc.returncode, **self._counts()}
        return None

    def status(self) -> dict:
        """What is known without touching the channel (safe while a request uses it)."""
        with self._lock:
            worker = self._pending or self._worker
        if (down := self._down(worker)) is not None:
            return down
        age = self.clock() - worker.last_heard
        state = "ok" if age <= self.spec.runtime.heartbeat_s or worker.ping_sent is None else "unresponsive"
        return {"draft": state, "pid": worker.proc.pid, "last_heard_s": round(age, 3), **worker.provider(),
                **self._counts()}

    def health(self, timeout_s: float = 2.0) -> dict:
        """A real probe: ping the worker and wait for its answer. Only call it while no request is
        using the channel (the Engine makes sure): it reads and discards whatever else arrives."""
        worker = self.current()
        if (down := self._down(worker)) is not None:
            if worker is not None:
                self.fail(worker, f"exited with code {worker.proc.returncode}")
            return down
        out = self._counts()
        sent = time.monotonic()
        if not worker.channel.send(Ping(seq=-1, sent=sent)):
            self.fail(worker, "not accepting messages")
            return {"draft": "dead", **out}
        while (left_s := sent + timeout_s - time.monotonic()) > 0:
            if (got := worker.channel.recv(left_s)) is not None:
                self.heard(worker, got[0])
                if isinstance(got[0], Pong):
                    return {"draft": "ok", "pid": worker.proc.pid, "rtt_ms": round((time.monotonic() - sent) * 1e3, 3),
                            "worker_dropped": got[0].dropped, "target_dropped": worker.channel.dropped,
                            **worker.provider(), **out}
        return {"draft": "unresponsive", "pid": worker.proc.pid, **out}
