"""`hetero-spec soak` (docs/serving.md): N greedy streams against a real `hetero-spec serve` on loopback, each
request checked against the prompt's non-streaming reference (text and usage); lost: an HTTP or connection error,
an error event, no `data: [DONE]`, or a malformed request answered otherwise than expected. A share of the requests
are cut by their client after the first event, and a share are malformed (MALFORMED: each with the status it must
get); at the end the server's /metrics must count exactly the errors sent, and nothing may stay in flight. Flat:
the server's VmRSS after the warm-up at most GROWTH_LIMIT above its first."""

import contextlib
import http.client
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .harness import BenchError, table, write_report
from .memory import status_mb

HOST, GROWTH_LIMIT, TIMEOUT_S = "127.0.0.1", 0.10, 600.0  # the first start may export a model
PROMPTS = ["def parse(", "import os\n", "class Stack:", "def read_lines(filename):", "for i in range(", "try:\n    ",
           "from typing import", "def __init__(self,", "if __name__ == \"__main__\":", "with open(path) as f:",
           "def fib(n):", "import json\n\ndef load(", "class Node:\n    def __init__(", "return sorted(",
           "def main(argv):", "while True:\n    "]


#: malformed requests: (endpoint, body bytes, the status the server must answer); `{model}` is the served model
MALFORMED = [
    ("completions", b'{"model": "{model}", "prompt": "x", "max_tokens": 2, "temprature": 0.5}', 400),
    ("completions", b'{"model": "{model}", "prompt": "x", "max_tokens": "5"}', 400),
    ("completions", b'{"model": "{model}", "prompt": "x",, }', 400),
    ("completions", b'{"model": "no-such-model", "prompt": "x"}', 404),
    ("completions", b'{"model": "{model}", "prompt": "x", "max_tokens": 1000000000}', 400),
    ("chat", b'{"model": "{model}", "messages": [{"role": "user", "content": "x", "mood": 1}]}', 400),
    ("chat", b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}', 404),
    ("chat", b'{not json', 400),
]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def wait_healthy(proc: subprocess.Popen, port: int, log_path: Path, timeout_s: float = TIMEOUT_S) -> None:
    """Poll GET /health until it answers 200; a BenchError with the log's end if the server exits or times out."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError, http.client.HTTPException, BenchError, ValueError):  # not up or healthy yet
            _request(port, "GET", "/health", timeout=10.0)
            return
        time.sleep(0.5)
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:]) if log_path.is_file() else "(no log)"
    why = f"exited with code {proc.returncode}" if proc.poll() is not None else f"was not healthy in {timeout_s:.0f} s"
    raise BenchError(f"the server {why}; the end of {log_path}:\n{tail}")


def _request(port: int, method: str, path: str, body: dict | bytes | None = None, timeout: float = TIMEOUT_S,
             status: int = 200) -> Any:
    """A JSON request (body: JSON, or bytes as they are): its parsed answer; a BenchError naming the request on any
    other status than `status`."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    with contextlib.closing(http.client.HTTPConnection(HOST, port, timeout=timeout)) as conn:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if body else {})
        if (resp := conn.getresponse()).status != status:
            raise BenchError(f"{method} {path} {body or ''} answered HTTP {resp.status}: {resp.read()[:300]!r}")
        return json.loads(resp.read())


def stream_completion(port: int, body: dict, timeout: float = TIMEOUT_S, cut: bool = False) -> tuple[str, dict]:
    """A streaming completion's (text, usage); RuntimeError on an HTTP error, an error event, no `data: [DONE]`.
    cut: the client goes away after the first event (its connection closed), returning what it had."""
    with contextlib.closing(http.client.HTTPConnection(HOST, port, timeout=timeout)) as conn:
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}).encode(),
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        if (resp := conn.getresponse()).status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        pieces, usage = [], {}
        while line := resp.readline():
            if not (line := line.strip()).startswith(b"data:"):
                continue  # blank separators, comments
            if cut:
                return "", {}
            if (data := line[5:].strip()) == b"[DONE]":
                return "".join(pieces), usage
            if "error" in (event := json.loads(data)):
                raise RuntimeError(f"error event: {event['error']}")
            pieces += [event["choices"][0].get("text") or ""] if event.get("choices") else []
            usage = event.get("usage") or usage
        raise RuntimeError("the stream ended without data: [DONE]")


def rss_summary(samples: list[list[float]], warmup_s: float) -> dict[str, Any]:
    """RSS after the warm-up (its first sample), at the end, its largest after the warm-up, growth, flat."""
    after = [mb for t, mb in samples if t >= warmup_s]
    growth = round(max(after) / after[0] - 1.0, 4) if after else None
    return {"rss_after_warmup_mb": after[0] if after else None, "rss_end_mb": samples[-1][1] if samples else None,
            "rss_max_after_warmup_mb": max(after) if after else None, "rss_growth": growth,
            "flat": growth is not None and growth <= GROWTH_LIMIT}


def server_counts(port: int) -> tuple[dict[tuple[str, str], float], float]:
    """The server's /metrics: responses by (endpoint, status), and requests in flight."""
    from prometheus_client.parser import text_string_to_metric_families

    with contextlib.closing(http.client.HTTPConnection(HOST, port, timeout=60.0)) as conn:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    counts = {(s.labels["endpoint"], s.labels["status"]): s.value for s in samples
              if s.name == "hetero_spec_requests_total"}
    return counts, next((s.value for s in samples if s.name == "hetero_spec_requests_in_flight"), 0.0)


def settle(port: int, timeout_s: float = 60.0) -> tuple[dict[tuple[str, str], float], float]:
    """/metrics once nothing is in flight (a cut stream leaves at its next round), or after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (got := server_counts(port))[1] > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def run_soak(config_path: Path, streams: int = 32, duration_s: float = 60.0, max_tokens: int = 64,
             warmup_s: float = 10.0, out: Path = Path("bench-out/soak"), overrides: list[str] | None = None,
             port: int = 0, say: Callable[[str], None] | None = None, cut_share: float = 1 / 3,
             malformed_share: float = 0.1) -> dict[str, Any]:
    """Start the server, take the references, run the streams for `duration_s` (each request cut by its client with
    probability cut_share, malformed with malformed_share; seeded per stream), check /metrics against what was sent,
    stop the server; write OUT/soak.json and .md."""
    say = say or (lambda m: print(f"soak: {m}", file=sys.stderr, flush=True))
    if not port:
        with socket.socket() as sock:  # a port nothing listens on now
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
    out = Path(out)
    say(f"starting the server on {HOST}:{port} (log: {out / 'server.log'})")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "server.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-c", "from hetero_spec.cli import main; raise SystemExit(main())",
                                 "serve", "--config", str(config_path), "--host", HOST, "--port", str(port),
                                 *(a for o in overrides or () for a in ("--set", o))],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    halt, lock, threads, samples = threading.Event(), threading.Lock(), [], []
    tally, sent_errors, errors = Counter(), Counter(), []  # tally: ok, lost, mismatches, tokens, cut
    try:
        wait_healthy(proc, port, out / "server.log")
        model = _request(port, "GET", "/v1/models", timeout=30.0)["data"][0]["id"]
        say(f"server healthy (pid {proc.pid}, model {model!r}); {len(PROMPTS)} reference completions")
        bodies = [{"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0} for p in PROMPTS]
        answers = (_request(port, "POST", "/v1/completions", b) for b in bodies)
        refs = [(r["choices"][0]["text"], r["usage"]) for r in answers]
        before, _ = settle(port)
        started = time.monotonic()

        def one(rng: random.Random, index: int) -> None:
            """One request on prompt `index`: malformed, cut, or whole (compared with its reference)."""
            if (draw := rng.random()) < malformed_share:
                endpoint, body, want = MALFORMED[rng.randrange(len(MALFORMED))]
                answer = _request(port, "POST", PATHS[endpoint], body.replace(b"{model}", model.encode()), status=want)
                if set(answer.get("error", {})) != {"message", "type", "param", "code"}:
                    raise RuntimeError(f"HTTP {want} without OpenAI's error body: {answer!r:.300}")
                with lock:
                    sent_errors[f"{endpoint} {want}"] += 1
            elif draw < malformed_share + cut_share:
                stream_completion(port, bodies[index], cut=True)
                with lock:
                    tally["cut"] += 1
            else:
                text, usage = stream_completion(port, {**bodies[index], "stream_options": {"include_usage": True}})
                with lock:
                    tally.update(ok=1, mismatches=int((text, usage) != refs[index]),
                                 tokens=int(usage.get("completion_tokens", 0)))

        def client(stream: int) -> None:
            rng = random.Random(stream)
            for request in itertools.count():
                try:
                    one(rng, (stream + request) % len(PROMPTS))
                except Exception as exc:  # noqa: BLE001 - any failure of a request is a lost request
                    with lock:
                        tally["lost"] += 1
                        if len(errors) < 20:  # the first few, for the report
                            errors.append(f"stream {stream}, request {request}: {type(exc).__name__}: {exc}")
                if halt.is_set() or time.monotonic() >= started + duration_s:
                    return

        say(f"{streams} streams for {duration_s:g} s (warm-up {warmup_s:g} s), {max_tokens} tokens per request")
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(streams)]
        for thread in threads:
            thread.start()
        while True:  # the server's RSS about every second, until the last client is done
            samples.append([round(time.monotonic() - started, 2), status_mb(proc.pid, "VmRSS")])
            if not (alive := [t for t in threads if t.is_alive()]):
                break
            alive[0].join(1.0)
            if len(samples) % 5 == 0:
                say(f"{time.monotonic() - started:5.0f} s: {tally['ok']} ok, {tally['lost']} lost, "
                    f"{tally['mismatches']} mismatched, {tally['tokens']} tokens, server RSS {samples[-1][1]} MB")
        wall = time.monotonic() - started
        after, in_flight = settle(port)
        answered = {key: int(n - before.get(key, 0.0)) for key, n in after.items()}  # during the soak
        counted = {f"{e} {s}": n for (e, s), n in answered.items()
                   if n and s.startswith("4") and s != "499" and e in PATHS}  # 499: the cut streams, below
    finally:
        halt.set()  # on an error or Ctrl-C the clients stop after their current request
        proc.terminate()  # SIGTERM (nothing if it has exited), then SIGKILL
        try:
            proc.wait(60.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for thread in threads:
            thread.join(5.0)
    samples = [s for s in samples if s[1] is not None]
    report: dict[str, Any] = {
        "config": str(config_path), "streams": streams, "duration_s": duration_s, "warmup_s": warmup_s,
        "max_tokens": max_tokens, "model": model, "prompts": len(PROMPTS), "wall_s": round(wall, 2),
        "requests_ok": tally["ok"], "requests_lost": tally["lost"], "token_mismatches": tally["mismatches"],
        "tokens": tally["tokens"], "tokens_per_s": round(tally["tokens"] / wall, 2) if wall > 0 else 0.0,
        "rss_samples": samples, **rss_summary(samples, warmup_s), "rss_growth_limit": GROWTH_LIMIT,
        "server_pid": proc.pid, "server_exit_code": proc.returncode, "errors": errors,
        "cut_share": cut_share, "malformed_share": malformed_share, "requests_cut": tally["cut"],
        "cut_counted_499": answered.get(("completions", "499"), 0), "errors_sent": dict(sorted(sent_errors.items())),
        "errors_counted": dict(sorted(counted.items())), "in_flight_after": in_flight}
    report["errors_match"] = report["errors_sent"] == report["errors_counted"]
    report["goal_met"] = (report["requests_lost"] == 0 and report["token_mismatches"] == 0 and report["flat"]
                          and report["errors_match"] and in_flight == 0)
    write_report(out, "soak", report, render(report))
    say(f"goal {'met' if report['goal_met'] else 'NOT met'}: {tally['ok']} ok, {tally['lost']} lost, "
        f"{tally['mismatches']} mismatched; wrote {out / 'soak.json'} and {out / 'soak.md'}")
    return report


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key}: {n}" for key, n in counts.items()) or "none"


def render(report: dict[str, Any]) -> str:
    growth, megabytes = report.get("rss_growth"), lambda v: "n/a" if v is None else f"{v:.1f}"
    rows = [("requests ok", report["requests_ok"]), ("requests lost", report["requests_lost"]),
            ("token mismatches", report["token_mismatches"]), ("tokens", report["tokens"]),
            ("tokens/s", f"{report['tokens_per_s']:.1f}"), ("wall (s)", f"{report['wall_s']:.1f}"),
            (f"RSS after warm-up ({report['warmup_s']:g} s) (MB)", megabytes(report["rss_after_warmup_mb"])),
            ("RSS max after warm-up (MB)", megabytes(report["rss_max_after_warmup_mb"])),
            ("RSS at the end (MB)", megabytes(report["rss_end_mb"])),
            ("RSS growth", "n/a" if growth is None else f"{growth * 100:.1f} %"),
            (f"RSS flat (<= {report['rss_growth_limit'] * 100:.0f} %)", "yes" if report["flat"] else "no"),
            ("requests cut by their client", report.get("requests_cut", 0)),
            ("... counted 499 by the server", report.get("cut_counted_499", 0)),
            ("malformed requests sent, by endpoint and status", _counts(report.get("errors_sent", {}))),
            ("... counted by the server's /metrics", _counts(report.get("errors_counted", {}))),
            ("requests in flight afterwards", f"{report.get('in_flight_after', 0):g}"),
            ("goal met", "yes" if report["goal_met"] else "no")]
    lines = [f"# hetero-spec soak: {report['streams']} streams for {report['duration_s']:g} s, "
             f"{report['max_tokens']} tokens per request", "", *table(["metric", "value"], rows)]
    lines += ["", "first errors:", "", *(f"- {e}" for e in report["errors"])] if report.get("errors") else []
    return "\n".join(lines) + "\n"
