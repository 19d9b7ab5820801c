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
from ..transport.channel import Channel, CurveKeys, check_bind_host
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
    curve: bool = False
    cpus: list[int] | None = None
    ready_timeout_s: float = 60.0
    heartbeat_s: float = 2.0
    restart_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    delay_ms: float = 0.0  # test only


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


class DraftSupervisor:
    """Owns the current worker. Only the engine thread talks on the channel; the restart thread only
    spawns a new worker and hands it over once it is ready."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        if spec.transport == "tcp":
            why = check_bind_host(spec.host, spec.curve)
            if why:
                raise WorkerStartError(why)
        self._lock = threading.Lock()
        self._worker: Worker | None = None
        self._pending: Worker | None = None
        self._restart_thread: threading.Thread | None = None
        self._closing = threading.Event()
        self.generation = 0
        self.restarts = 0
        self.failures = 0
        self.last_failure = ""

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the first worker and wait until it is ready; raises WorkerStartError naming the cause."""
        self._worker = self._spawn_ready()

    def _spawn(self) -> Worker:
        self.generation += 1
        curve = CurveKeys.generate() if self.spec.curve else None
        ch = Channel.bind(self.spec.transport, self.spec.host, self.spec.port, curve)
        cmd = [sys.executable, "-m", "hetero_spec.runtime.draft_worker", "--endpoint", ch.endpoint,
               "--model", str(self.spec.model), "--providers", ",".join(self.spec.providers),
               "--threads", str(self.spec.threads), "--vocab-width", str(self.spec.vocab_width),
               "--parent-pid", str(os.getpid()), "--delay-ms", str(self.spec.delay_ms)]
        if self.spec.cpus:
            cmd += ["--cpus", ",".join(map(str, self.spec.cpus))]
        env = dict(os.environ, **(curve.client_env() if curve else {}))
        err_path = os.path.join(os.path.dirname(ch.endpoint[6:]) if ch.endpoint.startswith("ipc://")
                                else "/tmp", f"hetero-spec-worker-{os.getpid()}-{self.generation}.log")
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    env=env, start_new_session=False)
        return Worker(proc=proc, channel=ch, generation=self.generation, stderr_path=err_path)

    def _spawn_ready(self) -> Worker:
        w = self._spawn()
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while time.monotonic() < deadline and not self._closing.is_set():
            got = w.channel.recv(0.1)
            if got is not None and isinstance(got[0], Ready):
                w.ready = got[0]
                w.last_heard = time.monotonic()
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
        raise WorkerStartError(f"draft worker did not become ready within {self.spec.ready_timeout_s:.0f} s "
                               f"(runtime.ready_timeout_s); model {self.spec.model}")

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
        try:
            os.unlink(w.stderr_path)
        except OSError:
            pass

    def close(self) -> None:
        """Shut every worker down cleanly (Shutdown, then SIGTERM, then SIGKILL); no orphans."""
        self._closing.set()
        if self._restart_thread is not None:
            self._restart_thread.join(timeout=self.spec.ready_timeout_s + 5)
        with self._lock:
            for w in (self._worker, self._pending):
                if w is not None:
                    self._reap(w, graceful=True)
            self._worker = self._pending = None

    # -- health -------------------------------------------------------------------------------------
    def current(self) -> Worker | None:
        """The usable worker, adopting a freshly restarted one; None while there is none."""
        with self._lock:
            if self._pending is not None:
                self._worker, self._pending = self._pending, None
            return self._worker

    def check(self, w: Worker) -> bool:
        """Liveness probe of the current worker; on death or hang, start a restart and return False."""
        now = time.monotonic()
        reason = ""
        if w.proc.poll() is not None:
            reason = f"exited with code {w.proc.returncode}"
        elif w.ping_sent is not None and now - w.ping_sent > self.spec.heartbeat_s:
            reason = f"no answer to a ping within {self.spec.heartbeat_s:.1f} s (hung)"
        elif w.ping_sent is None and now - w.last_heard > self.spec.heartbeat_s:
            w.ping_sent = now
            w.channel.send(Ping(seq=w.generation, sent=now))
        if not reason:
            return True
        self.fail(w, reason)
        return False

    def heard(self, w: Worker, msg) -> None:
        w.last_heard = time.monotonic()
        if isinstance(msg, Pong):
            w.ping_sent = None

    def fail(self, w: Worker, reason: str) -> None:
        log.warning("draft worker (pid %d) %s; the target continues alone and the worker is restarted",
                    w.proc.pid, reason)
        self.failures += 1
        self.last_failure = reason
        with self._lock:
            if self._worker is w:
                self._worker = None
        self._reap(w)
        if self._restart_thread is None or not self._restart_thread.is_alive():
            self._restart_thread = threading.Thread(target=self._restart_loop, name="draft-restart",
                                                    daemon=True)
            self._restart_thread.start()

    def _restart_loop(self) -> None:
        backoff = self.spec.restart_backoff_s * (2 ** min(self.failures - 1, 10))
        backoff = min(backoff, self.spec.max_backoff_s)
        while not self._closing.is_set():
            if self._closing.wait(backoff):
                return
            try:
                w = self._spawn_ready()
            except WorkerStartError as exc:
                log.warning("draft worker restart failed: %s", exc)
                backoff = min(backoff * 2, self.spec.max_backoff_s)
                continue
            with self._lock:
                if self._closing.is_set():
                    self._reap(w, graceful=True)
                    return
                self._pending = w
                self.restarts += 1
            log.info("draft worker restarted (pid %d)", w.proc.pid)
            return

    def health(self, timeout_s: float = 2.0) -> dict:
        """A real probe: ping the worker and wait for its answer."""
        w = self.current()
        if w is None:
            return {"draft": "restarting", "failures": self.failures, "last_failure": self.last_failure}
        if w.proc.poll() is not None:
            return {"draft": "dead", "exit_code": w.proc.returncode}
        t = time.monotonic()
        w.channel.send(Ping(seq=-1, sent=t))
        deadline = t + timeout_s
        while time.monotonic() < deadline:
            got = w.channel.recv(deadline - time.monotonic())
            if got is not None and isinstance(got[0], Pong):
                return {"draft": "ok", "pid": w.proc.pid, "rtt_ms": round((time.monotonic() - t) * 1e3, 3),
                        "restarts": self.restarts, "worker_dropped": got[0].dropped,
                        "target_dropped": w.channel.dropped}
        return {"draft": "unresponsive", "pid": w.proc.pid}
