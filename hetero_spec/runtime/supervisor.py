"""Target-side handle of the draft worker: spawn, readiness, health, restart with backoff, shutdown.

Readiness and health are real probes: a worker is ready when it has loaded its model and said Ready
over the channel; it is healthy while its process runs and it answers Ping within the heartbeat.
A worker that dies or hangs is killed and restarted in a background thread with exponential backoff;
meanwhile the target decodes alone.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import HeteroSpecError
from ..transport.channel import DEFAULT_MAX_MSG_BYTES, Channel, CurveKeys, ServerContext, check_bind_host
from ..transport.protocol import Failure, Ping, Pong, Ready, Shutdown

log = logging.getLogger(__name__)


class WorkerStartError(HeteroSpecError):
    """The draft worker did not become ready."""


@dataclass
class WorkerSpec:
    """Everything needed to start a draft worker."""

    model: Path
    providers: list[str]
    threads: int
    vocab_width: int
    transport: str = "ipc"
    host: str = "127.0.0.1"
    port: int = 0
    curve: bool = False              # CURVE on IPC too (TCP always uses it)
    curve_keys: Path | None = None   # configured keys (required beyond loopback); else ephemeral per worker
    cpus: list[int] | None = None
    ready_timeout_s: float = 60.0
    heartbeat_s: float = 2.0
    restart_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES
    max_streams: int = 64  # requests the worker drafts for at once (serving.max_batch and some)
    prompt_window: int | None = None  # draft.prompt_window


@dataclass
class Worker:
    """One incarnation of the worker process and its channel."""

    proc: subprocess.Popen
    channel: Channel
    generation: int
    ready: Ready | None = None
    last_heard: float = field(default_factory=time.monotonic)
    ping_sent: float | None = None
    stderr_path: str = ""


class ProcessLauncher:
    """Starts `python -m hetero_spec.runtime.draft_worker` on a fresh channel of the engine's context.
    CURVE keys (ephemeral per worker unless configured) go to the worker through its stdin pipe."""

    module = "hetero_spec.runtime.draft_worker"  # what `python -m` runs

    def __init__(self, server: ServerContext):
        self.server = server

    def launch(self, spec: WorkerSpec, generation: int) -> Worker:
        curve = None
        if spec.transport == "tcp" or spec.curve:
            curve = CurveKeys.load(spec.curve_keys) if spec.curve_keys else CurveKeys.generate()
        ch = Channel.bind(self.server, spec.transport, spec.host, spec.port, curve, name=f"worker-{generation}",
                          max_msg_bytes=spec.max_msg_bytes)
        cmd = [sys.executable, "-m", self.module, "--endpoint", ch.endpoint,
               "--model", str(spec.model), "--providers", ",".join(spec.providers),
               "--threads", str(spec.threads), "--vocab-width", str(spec.vocab_width),
               "--parent-pid", str(os.getpid()), "--max-msg-bytes", str(spec.max_msg_bytes)]
        cmd += ["--max-streams", str(spec.max_streams)]
        if spec.prompt_window:
            cmd += ["--prompt-window", str(spec.prompt_window)]
        if spec.cpus:
            cmd += ["--cpus", ",".join(map(str, spec.cpus))]
        if curve is not None:
            cmd += ["--keys-stdin"]
        err_path = self.server.path(f"worker-{generation}.log")
        try:
            with open(err_path, "wb") as err:
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if curve else subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=err)
            if curve is not None:
                try:
                    proc.stdin.write(curve.client_handover())
                    proc.stdin.close()
                except OSError:  # it died at once; readiness reports why
                    pass
        except BaseException:
            ch.close()
            raise
        return Worker(proc=proc, channel=ch, generation=generation, stderr_path=err_path)


class DraftSupervisor:
    """Owns the current worker. Only the thread serving a request talks on the channel; the restart
    thread only spawns a new worker and hands it over once it is ready. `launcher` and `clock` are
    seams for tests (an in-memory worker, a fake clock)."""

    def __init__(self, spec: WorkerSpec, launcher=None, clock=time.monotonic):
        self.spec = spec
        self.clock = clock
        if spec.transport == "tcp":
            why = check_bind_host(spec.host, spec.curve_keys is not None)
            if why:
                raise WorkerStartError(why)
        self._server: ServerContext | None = None
        if launcher is None:
            self._server = ServerContext()
            launcher = ProcessLauncher(self._server)
        self.launcher = launcher
        self._lock = threading.Lock()
        self._worker: Worker | None = None
        self._pending: Worker | None = None
        self._restart_thread: threading.Thread | None = None
        self._closing = threading.Event()
        self.generation = 0
        self.restarts = 0
        self.failures = 0
        self.last_failure = ""
        self._consecutive = 0

    @property
    def thread_ids(self) -> list[int]:
        """The ZeroMQ threads of this supervisor's own context (to pin them)."""
        return self._server.thread_ids if self._server is not None else []

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the first worker and wait until it is ready; raises WorkerStartError naming the cause."""
        try:
            self._worker = self._spawn_ready()
        except BaseException:
            self.close()
            raise

    def _spawn_ready(self) -> Worker:
        with self._lock:
            self.generation += 1
            generation = self.generation
        w = self.launcher.launch(self.spec, generation)
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while time.monotonic() < deadline and not self._closing.is_set():
            got = w.channel.recv(0.1)
            if got is not None and isinstance(got[0], Ready):
                why = self._check_ready(got[0])
                if why:
                    self._reap(w)
                    raise WorkerStartError(f"draft worker {self.spec.model}: {why}")
                w.ready = got[0]
                w.last_heard = self.clock()
                return w
            if got is not None and isinstance(got[0], Failure):
                self._reap(w)
                raise WorkerStartError(f"draft worker failed to load {self.spec.model}: {got[0].error}")
            if w.proc.poll() is not None:
                tail = self._stderr_tail(w)
                self._reap(w)
                raise WorkerStartError(f"draft worker exited with code {w.proc.returncode} before it was "
                                       f"ready ({self.spec.model}): {tail}")
        self._reap(w)
        if self._closing.is_set():
            raise WorkerStartError("the engine is closing")
        raise WorkerStartError(f"draft worker did not become ready within {self.spec.ready_timeout_s:.0f} s "
                               f"(runtime.ready_timeout_s); model {self.spec.model}")

    def _check_ready(self, r: Ready) -> str:
        if r.vocab_width != self.spec.vocab_width:
            return (f"it reports a vocabulary width of {r.vocab_width}, the target's is "
                    f"{self.spec.vocab_width}")
        if r.context_len < 2:
            return f"it reports a context length of {r.context_len}"
        return ""

    @staticmethod
    def _stderr_tail(w: Worker) -> str:
        try:
            return Path(w.stderr_path).read_text(errors="replace")[-1500:].strip() or "(no output)"
        except OSError:
            return "(no output)"

    def _reap(self, w: Worker, graceful: bool = False) -> None:
        if graceful and w.proc.poll() is None:
            try:
                w.channel.send(Shutdown())
                w.proc.wait(timeout=2.0)
            except (subprocess.TimeoutExpired, Exception):  # noqa: BLE001 - escalate below
                pass
        if w.proc.poll() is None:
            w.proc.terminate()
            try:
                w.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        w.channel.close()
        if w.stderr_path:
            try:
                os.unlink(w.stderr_path)
            except OSError:
                pass

    def close(self) -> None:
        """Shut every worker down cleanly (Shutdown, then SIGTERM, then SIGKILL); no orphans. Then end
        the engine's ZeroMQ context and remove its private directory (sockets, logs)."""
        self._closing.set()
        t = self._restart_thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=self.spec.ready_timeout_s + 5)
        with self._lock:
            workers = [w for w in (self._worker, self._pending) if w is not None]
            self._worker = self._pending = None
        for w in workers:
            self._reap(w, graceful=True)
        if self._server is not None:
            self._server.close()

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    # -- health -------------------------------------------------------------------------------------
    def current(self) -> Worker | None:
        """The usable worker, adopting a freshly restarted one; None while there is none."""
        with self._lock:
            if self._pending is not None:
                self._worker, self._pending = self._pending, None
            return self._worker

    def check(self, w: Worker) -> bool:
        """Liveness probe of the current worker; on death or hang, start a restart and return False."""
        if w.channel.closed:  # reaped already (a failure seen elsewhere)
            return False
        now = self.clock()
        reason = ""
        if w.proc.poll() is not None:
            reason = f"exited with code {w.proc.returncode}"
        elif w.ping_sent is not None and now - w.ping_sent > self.spec.heartbeat_s:
            reason = f"no answer to a ping within {self.spec.heartbeat_s:.1f} s (hung)"
        elif w.ping_sent is None and now - w.last_heard > self.spec.heartbeat_s:
            w.ping_sent = now
            if not w.channel.send(Ping(seq=w.generation, sent=now)):
                reason = "not accepting messages"
        if not reason:
            return True
        self.fail(w, reason)
        return False

    def heard(self, w: Worker, msg) -> None:
        w.last_heard = self.clock()
        self._consecutive = 0
        if isinstance(msg, Pong):
            w.ping_sent = None

    def fail(self, w: Worker, reason: str) -> None:
        """Declare `w` dead: reap it (idempotent) and restart in the background."""
        with self._lock:
            if w.channel.closed and self._worker is not w:
                return  # already handled
            if self._worker is w:
                self._worker = None
        log.warning("draft worker (pid %d) %s; the target continues alone and the worker is restarted",
                    w.proc.pid, reason)
        self.failures += 1
        self._consecutive = self._consecutive + 1
        self.last_failure = reason
        self._reap(w)
        if self._closing.is_set():
            return
        if self._restart_thread is None or not self._restart_thread.is_alive():
            self._restart_thread = threading.Thread(target=self._restart_loop, name="draft-restart",
                                                    daemon=True)
            self._restart_thread.start()

    def _restart_loop(self) -> None:
        backoff = self.spec.restart_backoff_s * (2 ** min(max(self._consecutive, 1) - 1, 10))
        backoff = min(backoff, self.spec.max_backoff_s)
        while not self._closing.is_set():
            if self._closing.wait(backoff):
                return
            try:
                w = self._spawn_ready()
            except WorkerStartError as exc:
                if self._closing.is_set():
                    return
                log.warning("draft worker restart failed: %s", exc)
                backoff = min(backoff * 2, self.spec.max_backoff_s)
                continue
            except Exception as exc:  # noqa: BLE001 - e.g. the context closed under us
                if self._closing.is_set():
                    return
                log.warning("draft worker restart failed: %s", exc)
                backoff = min(backoff * 2, self.spec.max_backoff_s)
                continue
            with self._lock:
                closing = self._closing.is_set()
                if not closing:
                    self._pending = w
                    self.restarts += 1
            if closing:
                self._reap(w, graceful=True)
                return
            log.info("draft worker restarted (pid %d)", w.proc.pid)
            return

    def status(self) -> dict:
        """What is known without touching the channel (safe while a request uses it)."""
        with self._lock:
            w = self._pending or self._worker
        out = {"restarts": self.restarts, "failures": self.failures, "last_failure": self.last_failure}
        if w is None:
            return {"draft": "restarting" if not self.closed else "closed", **out}
        if w.proc.poll() is not None:
            return {"draft": "dead", "exit_code": w.proc.returncode, **out}
        age = self.clock() - w.last_heard
        state = "ok" if age <= self.spec.heartbeat_s or w.ping_sent is None else "unresponsive"
        return {"draft": state, "pid": w.proc.pid, "last_heard_s": round(age, 3), **out}

    def health(self, timeout_s: float = 2.0) -> dict:
        """A real probe: ping the worker and wait for its answer. Only call it while no request is
        using the channel (the Engine makes sure): it reads and discards whatever else arrives."""
        w = self.current()
        out = {"restarts": self.restarts, "failures": self.failures, "last_failure": self.last_failure}
        if w is None:
            return {"draft": "restarting" if not self.closed else "closed", **out}
        if w.proc.poll() is not None:
            self.fail(w, f"exited with code {w.proc.returncode}")
            return {"draft": "dead", "exit_code": w.proc.returncode, **out}
        t = time.monotonic()
        if not w.channel.send(Ping(seq=-1, sent=t)):
            self.fail(w, "not accepting messages")
            return {"draft": "dead", **out}
        deadline = t + timeout_s
        while time.monotonic() < deadline:
            got = w.channel.recv(deadline - time.monotonic())
            if got is not None:
                self.heard(w, got[0])
                if isinstance(got[0], Pong):
                    return {"draft": "ok", "pid": w.proc.pid,
                            "rtt_ms": round((time.monotonic() - t) * 1e3, 3),
                            "worker_dropped": got[0].dropped, "target_dropped": w.channel.dropped, **out}
        return {"draft": "unresponsive", "pid": w.proc.pid, **out}
