"""A soak of `hetero-spec serve --ray` with two replicas: --streams client threads keep greedy streaming completions
going for --duration seconds, each request on a new connection (Python's urllib, as a plain client sends them),
and every output is compared with one Engine's answer to the same prompt. Reports requests lost (an error, or no
[DONE]), outputs that differ, and each replica's requests (the x-hetero-spec-replica header), so both
replicas' share of the load shows. Writes OUT/ray_soak.json and OUT/ray_soak.md; exits 1 when a request was lost
or changed, or a replica served none.

    .venv/bin/python scripts/ray_soak.py --config configs/cpu-demo.yaml --duration 300 --streams 16 --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

from hetero_spec import Engine
from hetero_spec.config import load_config
from hetero_spec.serve.ray_serve import REPLICA_HEADER

SETTINGS = {"serving.ray.num_replicas": 2, "serving.ray.cpus_per_replica": 1, "runtime.mode": "in_process",
            "runtime.cpus": None, "target.threads": 1}
PROMPTS = [f"def task_{i}(items):\n    \"\"\"Return the {i}th" for i in range(32)]


def stream(port: int, model: str, prompt: str, max_tokens: int) -> tuple[str, str, bool]:
    """(text, replica, ended with [DONE] and no error event)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    text, done, error = [], False, False
    with urllib.request.urlopen(req, timeout=300) as resp:
        replica = resp.headers.get(REPLICA_HEADER, "?")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            error = error or "error" in event
            text += [choice.get("text", "") for choice in event.get("choices", [])]
    return "".join(text), replica, done and not error


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/cpu-demo.yaml")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--out", type=Path, default=Path("OUT"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    config = load_config(args.config, overrides=SETTINGS)
    model = config.target.model.name
    print("references from one Engine ...", flush=True)
    with Engine.from_config(config) as engine:
        refs = {p: engine.generate(p, max_new_tokens=args.max_tokens, temperature=0.0).text for p in PROMPTS}
    sets = [a for key, value in SETTINGS.items() for a in ("--set", f"{key}={'null' if value is None else value}")]
    cmd = [str(Path(sys.executable).parent / "hetero-spec"), "serve", "--ray", "--config", args.config,
           "--port", str(args.port), *sets]
    log = (args.out / "server.log").open("w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    tally: Counter = Counter()
    replicas: Counter = Counter()
    lock = threading.Lock()
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited; see {args.out / 'server.log'}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=10) as resp:
                    if json.load(resp).get("replicas", {}).get("all_ready"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the replicas did not become ready in 600 s")
            time.sleep(1)
        print(f"both replicas ready; {args.streams} streams for {args.duration:.0f} s", flush=True)
        started = time.monotonic()
        end = started + args.duration

        def client(index: int) -> None:
            n = index
            while time.monotonic() < end:
                prompt = PROMPTS[n % len(PROMPTS)]
                n += args.streams
                try:
                    text, replica, ok = stream(args.port, model, prompt, args.max_tokens)
                except Exception:  # noqa: BLE001 - a lost request is counted, the soak goes on
                    with lock:
                        tally["lost"] += 1
                    continue
                with lock:
                    tally["requests"] += 1
                    tally["lost"] += not ok
                    tally["changed"] += ok and text != refs[prompt]
                    replicas[replica] += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=30)
                with lock:
                    print(f"{time.monotonic() - started:.0f} s: {dict(tally)}, per replica {dict(replicas)}",
                          flush=True)
        wall = time.monotonic() - started
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=120)
        log.close()
    report = {"command": " ".join(["scripts/ray_soak.py", *sys.argv[1:]]), "duration_s": round(wall, 1),
              "streams": args.streams, "max_tokens": args.max_tokens, **tally,
              "per_replica_requests": dict(replicas), "requests_per_s": round(tally["requests"] / wall, 2),
              "server_exit_code": server.returncode}
    (args.out / "ray_soak.json").write_text(json.dumps(report, indent=1))
    rows = "\n".join(f"| {name} | {count} | {count / max(1, tally['requests']):.0%} |" for name, count in
                     sorted(replicas.items()))
    (args.out / "ray_soak.md").write_text(
        f"`{report['command']}`: {report['requests']} requests in {wall:.0f} s ({report['requests_per_s']}/s), "
        f"{tally['lost']} lost, {tally['changed']} changed\n\n| replica | requests | share |\n|---|---:|---:|\n{rows}\n")
    print(json.dumps(report, indent=1))
    return 0 if not tally["lost"] and not tally["changed"] and len(replicas) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
