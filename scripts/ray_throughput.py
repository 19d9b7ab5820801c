"""Ray Serve's overhead: aggregate throughput of `hetero-spec serve --ray` with two replicas against two separate
`hetero-spec serve` processes (each pinned to one core with taskset, no balancer: clients alternate between them),
under the same concurrent load of greedy completions. The two setups run in turn, `--repeats` times each
(A B A B ...); the report gives each run's tokens per second, latencies, and the median of the paired ratios.
The default 256 requests (16 waves of 16) measure the sustained rate: in a run of 64 the last wave, where
the balancer's split leaves one replica idle while the other finishes, is a quarter of the run. Each run also
reports its mean batch: the requests an Engine decoded together per round, from the servers' metrics.

    .venv/bin/python scripts/ray_throughput.py --config configs/cpu-demo.yaml --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hetero_spec.serve.ray_serve import MIRROR_EVERY_S

ONE_CORE = ["runtime.mode=in_process", "runtime.cpus=null", "target.threads=1", "target.prefill_threads=1",
            "draft.threads=1", "serving.max_batch=8"]
RAY = ["serving.ray.num_replicas=2", "serving.ray.cpus_per_replica=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli() -> list[str]:
    return [str(Path(sys.executable).with_name("hetero-spec"))]


def start(cmd: list[str], log: Path, cpu: int | None = None) -> subprocess.Popen:
    """A server in a process group of its own (to stop it and all it started) but in this session: with the
    kernel's autogroup scheduling (sched_autogroup_enabled) each session shares the cores as one task group,
    and a server in a session of its own then starves this load generator by its group's share. Under
    `serve --ray`, where all of Ray's processes share the server's session, the clients here stalled for
    100-440 ms at a time and the replicas' batches ran part-empty."""
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, process_group=0)


def wait_up(urls: list[str], procs: list[subprocess.Popen], limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    for url in urls:
        while True:
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f"a server exited while starting (see the log under --out): {url}")
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not come up within {limit_s} s")
            time.sleep(1)


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to each server (it drains and shuts down what it started, as on Ctrl-C; a background job ignores
    SIGINT), then SIGKILL to whatever is left of its group."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(120)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def load(urls: list[str], model: str, prompts: list[str], concurrency: int, max_tokens: int,
         stream: bool = False) -> dict:
    """Every prompt once, `concurrency` at a time, alternating between the urls: tokens per second overall, and
    the seconds to each response's first byte (with `stream`: its first token, where a balancer's wait shows)."""
    local = threading.local()
    clients: list[httpx.Client] = []

    def one(i: int) -> tuple[int, float]:
        # one keep-alive client per thread, as a load generator keeps its connections: a new httpx client per
        # request costs the client ~45 ms of CPU (its SSL context), which throttled the load it offered
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=600)
            clients.append(local.client)
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        t0, first, tokens = time.perf_counter(), None, 0
        with local.client.stream("POST", urls[i % len(urls)] + "/v1/completions", json=body) as r:
            r.raise_for_status()
            if not stream:
                first = time.perf_counter() - t0
                return json.loads(r.read())["usage"]["completion_tokens"], first
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                first = first or time.perf_counter() - t0
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
        return tokens, first or 0.0

    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, range(len(prompts))))
    wall = time.perf_counter() - t
    for c in clients:
        c.close()
    tokens = sum(n for n, _ in done)
    firsts = sorted(f for _, f in done)
    q = {f"first_p{p}_s": round(firsts[min(len(firsts) - 1, p * len(firsts) // 100)], 3) for p in (50, 75, 90, 100)}
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2), **q}


def batch_totals(urls: list[str]) -> tuple[float, float]:
    """The sum and count of hetero_spec_batch_size (requests decoded together per round) over the /metrics
    pages at `urls` (a server's own, or Ray's, where the replicas' gauges carry a `ray_` prefix)."""
    total = {"hetero_spec_batch_size_sum": 0.0, "hetero_spec_batch_size_count": 0.0}
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(url, timeout=30).text):
            for s in family.samples:
                if (name := s.name.removeprefix("ray_")) in total:
                    total[name] += s.value
    return total["hetero_spec_batch_size_sum"], total["hetero_spec_batch_size_count"]


def run_setup(kind: str, config: str, model: str, prompts: list[str], args, out: Path) -> dict:
    sets = [a for s in ONE_CORE + args.set for a in ("--set", s)]
    if kind == "ray":
        port, metrics_port = free_port(), free_port()
        ray_sets = [*RAY, f"serving.ray.metrics_export_port={metrics_port}", *args.ray_set]
        procs = [start([*cli(), "serve", "--config", config, "--ray", "--port", str(port), "--model-name", model,
                        *sets, *[a for s in ray_sets for a in ("--set", s)]], out / "ray.log")]
        urls = [f"http://127.0.0.1:{port}"]
        metrics = [f"http://127.0.0.1:{metrics_port}/metrics"]
    else:
        ports = [free_port(), free_port()]
        procs = [start([*cli(), "serve", "--config", config, "--port", str(p), "--model-name", model, *sets],
                       out / f"serve-{i}.log", cpu=i) for i, p in enumerate(ports)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        metrics = [u + "/metrics" for u in urls]
    # a replica's gauges reach Ray's page after its next mirror and Ray's next report (every 10 s)
    settle_s = MIRROR_EVERY_S + 11 if kind == "ray" else 0
    try:
        wait_up(urls, procs)
        load(urls, model, prompts[: args.concurrency], args.concurrency, 8)  # warm-up
        time.sleep(settle_s)
        s0, n0 = batch_totals(metrics)
        r = load(urls, model, prompts, args.concurrency, args.max_tokens, args.stream)
        time.sleep(settle_s)
        s1, n1 = batch_totals(metrics)
        return r | {"mean_batch": round((s1 - s0) / max(1.0, n1 - n0), 2)}
    finally:
        stop(procs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/cpu-demo.yaml")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="OUT")
    p.add_argument("--stream", action="store_true",
                   help="stream the completions (the first token's time then shows each request's wait)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="another config override for both setups (repeatable)")
    p.add_argument("--ray-set", action="append", default=[], metavar="KEY=VALUE",
                   help="another config override for the Ray setup only (repeatable)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [f"def task_{i}(items):\n    \"\"\"Return the {i}th" for i in range(args.requests)]
    runs: dict[str, list[dict]] = {"ray": [], "two_serves": []}
    for rep in range(args.repeats):
        for kind in ("ray", "two_serves") if rep % 2 == 0 else ("two_serves", "ray"):
            r = run_setup(kind, args.config, "demo", prompts, args, out)
            runs[kind].append(r)
            q = "/".join(str(r[f"first_p{p}_s"]) for p in (50, 75, 90, 100))
            print(f"ray_throughput: repeat {rep + 1}/{args.repeats} {kind}: {r['tokens_per_s']} tok/s, mean batch "
                  f"{r['mean_batch']}, first byte p50/p75/p90/max {q} s", flush=True)
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["ray"], runs["two_serves"])]
    report = {"config": args.config, "requests": args.requests, "concurrency": args.concurrency,
              "max_tokens": args.max_tokens, "runs": runs, "ratios": [round(x, 3) for x in ratios],
              "median_ratio": round(statistics.median(ratios), 3)}
    (out / "ray_throughput.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("ratios", "median_ratio")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
