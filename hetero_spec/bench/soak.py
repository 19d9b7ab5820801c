"""`hetero-spec soak`: a long run of concurrent streams against a real `hetero-spec serve` on loopback.

The goal measured (issue 11): N concurrent streams (default 32) for a while (default 60 s) lose no request and
no token, and the server's resident memory stays flat after warm-up (within 10 %).

How: the server is started as a subprocess (`hetero-spec serve` on a free 127.0.0.1 port, its output in
OUT/server.log) and waited for until GET /health answers 200. A fixed set of short code-like prompts gets a
reference answer each: one non-streaming greedy POST /v1/completions (text and usage). Then N client threads
(standard-library HTTP only) loop until the deadline, each request a greedy streaming completion with
`stream_options.include_usage`; every thread finishes at least one request, and a request that starts before
the deadline runs to its end. Per request:

- lost: an HTTP error, a connection error, an error event in the stream, or a stream without `data: [DONE]`;
- token mismatch: it completed, but its concatenated text or its usage differs from the prompt's reference;
- ok: it completed (mismatching or not); its usage.completion_tokens count towards `tokens`.

Meanwhile a sampler reads VmRSS of the server process (/proc/PID/status, the serving process only, not a draft
worker it may spawn) every second from the start of the soak. Warm-up is the first `warmup_s` seconds; growth
is the largest sample after warm-up over the first sample after warm-up, minus 1; flat means growth <= 0.10.
The goal is met when nothing was lost, nothing mismatched and RSS is flat.

The server is always stopped at the end (SIGTERM, then SIGKILL after 60 s), also on errors and Ctrl-C. Writes
OUT/soak.json (every number, RSS samples as [t_s, MB]) and OUT/soak.md.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .context import BenchError

HOST = "127.0.0.1"
GROWTH_LIMIT = 0.10
HEALTH_TIMEOUT_S = 600.0  # the first start may export a model
REQUEST_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0

PROMPTS = [
    "def parse(",
    "import os\n",
    "class Stack:",
    "def read_lines(filename):",
    "for i in range(",
    "from typing import",
    "def __init__(self,",
    "if __name__ == \"__main__\":",
    "with open(path) as f:",
    "try:\n    ",
    "def fib(n):",
    "import json\n\ndef load(",
    "class Node:\n    def __init__(",
    "return sorted(",
    "while True:\n    ",
    "def main(argv):",
]


class StreamError(Exception):
    """One request failed: an HTTP status other than 200, a broken connection, an error event, no [DONE]."""


# -- the server ----------------------------------------------------------------------------------------
def free_port(host: str = HOST) -> int:
    """A port nothing listens on right now (bind to port 0, read it back, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _override_args(overrides: list[str] | dict[str, Any] | None) -> list[str]:
    """--set arguments for the server: KEY.PATH=VALUE strings as given, or a mapping (values as JSON, which
    the server parses as YAML)."""
    if not overrides:
        return []
    pairs = [f"{k}={json.dumps(v)}" for k, v in overrides.items()] if isinstance(overrides, dict) \
        else list(overrides)
    return [a for p in pairs for a in ("--set", p)]


def start_server(config_path: Path, port: int, log_path: Path,
                 overrides: list[str] | dict[str, Any] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "from hetero_spec.cli import main; raise SystemExit(main())",
           "serve", "--config", str(config_path), "--host", HOST, "--port", str(port), *_override_args(overrides)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


def _log_tail(log_path: Path, n: int = 20) -> str:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no server log)"
    return "\n".join(lines[-n:]) or "(the server log is empty)"


def wait_healthy(proc: subprocess.Popen, port: int, log_path: Path, timeout_s: float = HEALTH_TIMEOUT_S,
                 poll_s: float = 0.5) -> None:
    """Poll GET /health until it answers 200; fail when the server exits or the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise BenchError(f"the server exited with code {proc.returncode} before it was healthy; "
                             f"the end of {log_path}:\n{_log_tail(log_path)}")
        try:
            status, _ = _request(port, "GET", "/health", timeout=10.0)
            if status == 200:
                return
        except (OSError, http.client.HTTPException):
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise BenchError(f"the server was not healthy within {timeout_s:.0f} s; the end of {log_path}:\n"
                             f"{_log_tail(log_path)}")
        time.sleep(poll_s)


def stop_server(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM, wait, then SIGKILL; returns the exit code. Leaves no process behind."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


# -- HTTP ------------------------------------------------------------------------------------------------
def _request(port: int, method: str, path: str, body: dict | None = None, host: str = HOST,
             timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def complete(host: str, port: int, body: dict) -> tuple[str, dict]:
    """A non-streaming completion: (text, usage)."""
    status, raw = _request(port, "POST", "/v1/completions", {**body, "stream": False}, host=host)
    if status != 200:
        raise StreamError(f"HTTP {status}: {raw[:300]!r}")
    out = json.loads(raw)
    return out["choices"][0]["text"], out["usage"]


def stream_completion(host: str, port: int, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> tuple[str, dict]:
    """A streaming completion read as server-sent events: (the concatenated choices[0].text, the usage of the
    chunk that carries it, {} when none does). Raises StreamError on an HTTP error, an error event, or a
    stream that ends without `data: [DONE]`; connection errors propagate as OSError/HTTPException."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}).encode(),
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise StreamError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        pieces: list[str] = []
        usage: dict = {}
        while True:
            line = resp.readline()
            if not line:
                raise StreamError("the stream ended without data: [DONE]")
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments
            data = line[5:].strip()
            if data == b"[DONE]":
                return "".join(pieces), usage
            event = json.loads(data)
            if "error" in event:
                raise StreamError(f"error event: {event['error']}")
            if event.get("choices"):
                pieces.append(event["choices"][0].get("text") or "")
            if event.get("usage"):
                usage = event["usage"]
    finally:
        conn.close()


# -- RSS ---------------------------------------------------------------------------------------------------
def read_rss_mb(pid: int) -> float | None:
    """VmRSS of a process in MB (from /proc/PID/status, kB), None when it is gone or has none."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


class RssSampler(threading.Thread):
    """Samples a process's RSS every `every_s` seconds, from start() until stop() (which takes a last one)."""

    def __init__(self, pid: int, every_s: float = 1.0):
        super().__init__(name="soak-rss", daemon=True)
        self.pid, self.every_s = pid, every_s
        self.samples: list[list[float]] = []  # [t_s since start, MB]
        self._stop_ev = threading.Event()
        self._t0 = time.monotonic()

    def _sample(self) -> None:
        mb = read_rss_mb(self.pid)
        if mb is not None:
            self.samples.append([round(time.monotonic() - self._t0, 2), round(mb, 2)])

    def run(self) -> None:
        self._t0 = time.monotonic()
        while True:
            self._sample()
            if self._stop_ev.wait(self.every_s):
                break

    def stop(self) -> None:
        self._stop_ev.set()
        self.join()
        self._sample()

    def latest_mb(self) -> float | None:
        return self.samples[-1][1] if self.samples else None


def rss_summary(samples: list[list[float]], warmup_s: float) -> dict[str, Any]:
    """The RSS fields of the report: first sample after warm-up, the last, the largest after warm-up, growth."""
    after = [mb for t, mb in samples if t >= warmup_s]
    if not after:
        return {"rss_after_warmup_mb": None, "rss_end_mb": samples[-1][1] if samples else None,
                "rss_max_after_warmup_mb": None, "rss_growth": None, "flat": False}
    growth = max(after) / after[0] - 1.0
    return {"rss_after_warmup_mb": after[0], "rss_end_mb": samples[-1][1], "rss_max_after_warmup_mb": max(after),
            "rss_growth": round(growth, 4), "flat": growth <= GROWTH_LIMIT}


# -- the soak ------------------------------------------------------------------------------------------------
class _Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.ok = self.lost = self.mismatches = self.tokens = 0
        self.errors: list[str] = []  # the first few, for the report

    def add(self, *, lost: str | None = None, mismatch: bool = False, tokens: int = 0) -> None:
        with self.lock:
            if lost is not None:
                self.lost += 1
                if len(self.errors) < 20:
                    self.errors.append(lost)
                return
            self.ok += 1
            self.mismatches += int(mismatch)
            self.tokens += tokens


def _client(i: int, port: int, model: str, max_tokens: int, refs: list[tuple[str, dict]], deadline: float,
            tally: _Tally, halt: threading.Event) -> None:
    """One stream: requests back to back until the deadline (at least one)."""
    it = 0
    while True:
        k = (i + it) % len(PROMPTS)
        body = {"model": model, "prompt": PROMPTS[k], "max_tokens": max_tokens, "temperature": 0,
                "stream_options": {"include_usage": True}}
        try:
            text, usage = stream_completion(HOST, port, body)
        except Exception as exc:  # noqa: BLE001 - any failure of a request is a lost request
            tally.add(lost=f"stream {i}, request {it}: {type(exc).__name__}: {exc}")
        else:
            ref_text, ref_usage = refs[k]
            tally.add(mismatch=text != ref_text or usage != ref_usage,
                      tokens=int(usage.get("completion_tokens", 0)))
        it += 1
        if halt.is_set() or time.monotonic() >= deadline:
            return


def run_soak(config_path: Path, streams: int = 32, duration_s: float = 60.0, max_tokens: int = 64,
             warmup_s: float = 10.0, out: Path = Path("bench-out/soak"),
             overrides: list[str] | dict[str, Any] | None = None, port: int = 0,
             say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Start the server, take the references, soak it with `streams` streams for `duration_s`, stop it, and
    write OUT/soak.json and OUT/soak.md. Returns the report."""
    say = say or (lambda m: print(f"soak: {m}", file=sys.stderr, flush=True))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "server.log"
    port = port or free_port()
    say(f"starting the server on {HOST}:{port} (log: {log_path})")
    proc = start_server(Path(config_path), port, log_path, overrides)
    halt = threading.Event()
    threads: list[threading.Thread] = []
    sampler: RssSampler | None = None
    try:
        wait_healthy(proc, port, log_path)
        status, raw = _request(port, "GET", "/v1/models", timeout=30.0)
        if status != 200:
            raise BenchError(f"GET /v1/models answered HTTP {status}: {raw[:300]!r}")
        model = json.loads(raw)["data"][0]["id"]
        say(f"server healthy (pid {proc.pid}, model {model!r}); {len(PROMPTS)} reference completions")
        refs = []
        for p in PROMPTS:
            try:
                refs.append(complete(HOST, port, {"model": model, "prompt": p, "max_tokens": max_tokens,
                                                  "temperature": 0}))
            except (StreamError, OSError, http.client.HTTPException) as exc:
                raise BenchError(f"the reference completion of {p!r} failed: {exc}; the end of {log_path}:\n"
                                 f"{_log_tail(log_path)}") from None

        say(f"{streams} streams for {duration_s:g} s (warm-up {warmup_s:g} s), {max_tokens} tokens per request")
        tally = _Tally()
        sampler = RssSampler(proc.pid)
        sampler.start()
        t0 = time.monotonic()
        deadline = t0 + duration_s
        threads = [threading.Thread(target=_client, name=f"soak-{i}", daemon=True,
                                    args=(i, port, model, max_tokens, refs, deadline, tally, halt))
                   for i in range(streams)]
        for t in threads:
            t.start()
        next_say = t0 + 5.0
        while True:
            alive = [t for t in threads if t.is_alive()]
            if not alive:
                break
            alive[0].join(max(0.0, next_say - time.monotonic()))
            if time.monotonic() >= next_say:
                next_say += 5.0
                rss = sampler.latest_mb()
                with tally.lock:
                    say(f"{time.monotonic() - t0:5.0f} s: {tally.ok} requests ok, {tally.lost} lost, "
                        f"{tally.mismatches} mismatched, {tally.tokens} tokens, server RSS "
                        + (f"{rss:.0f} MB" if rss is not None else "?"))
        wall = time.monotonic() - t0
        sampler.stop()  # a last sample while the server still runs
    finally:
        halt.set()  # on an error or Ctrl-C the clients stop after their current request
        if sampler is not None and sampler.is_alive():
            sampler.stop()
        code = stop_server(proc)
        for t in threads:
            t.join(5.0)

    report: dict[str, Any] = {
        "config": str(config_path), "streams": streams, "duration_s": duration_s, "warmup_s": warmup_s,
        "max_tokens": max_tokens, "model": model, "prompts": len(PROMPTS), "wall_s": round(wall, 2),
        "requests_ok": tally.ok, "requests_lost": tally.lost, "token_mismatches": tally.mismatches,
        "tokens": tally.tokens, "tokens_per_s": round(tally.tokens / wall, 2) if wall > 0 else 0.0,
        "rss_samples": sampler.samples, **rss_summary(sampler.samples, warmup_s),
        "rss_growth_limit": GROWTH_LIMIT, "server_pid": proc.pid, "server_exit_code": code,
        "errors": tally.errors}
    report["goal_met"] = bool(report["requests_lost"] == 0 and report["token_mismatches"] == 0 and report["flat"])
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    (out / "soak.md").write_text(render(report))
    say(f"{'goal met' if report['goal_met'] else 'goal NOT met'}: {tally.ok} ok, {tally.lost} lost, "
        f"{tally.mismatches} mismatched; wrote {out / 'soak.json'} and {out / 'soak.md'}")
    return report


def _mb(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def render(report: dict[str, Any]) -> str:
    growth = report.get("rss_growth")
    lines = [f"# hetero-spec soak: {report['streams']} streams for {report['duration_s']:g} s, "
             f"{report['max_tokens']} tokens per request",
             "", "| metric | value |", "|---|---:|",
             f"| requests ok | {report['requests_ok']} |",
             f"| requests lost | {report['requests_lost']} |",
             f"| token mismatches | {report['token_mismatches']} |",
             f"| tokens | {report['tokens']} |",
             f"| tokens/s | {report['tokens_per_s']:.1f} |",
             f"| wall (s) | {report['wall_s']:.1f} |",
             f"| RSS after warm-up ({report['warmup_s']:g} s) (MB) | {_mb(report['rss_after_warmup_mb'])} |",
             f"| RSS max after warm-up (MB) | {_mb(report['rss_max_after_warmup_mb'])} |",
             f"| RSS at the end (MB) | {_mb(report['rss_end_mb'])} |",
             f"| RSS growth | {'n/a' if growth is None else f'{growth * 100:.1f} %'} |",
             f"| RSS flat (<= {report['rss_growth_limit'] * 100:.0f} %) | {'yes' if report['flat'] else 'no'} |",
             f"| goal met | {'yes' if report['goal_met'] else 'no'} |"]
    if report.get("errors"):
        lines += ["", "first errors:", ""] + [f"- {e}" for e in report["errors"]]
    return "\n".join(lines) + "\n"
