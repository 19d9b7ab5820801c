"""`hetero-spec load`: aggregate throughput and per-request latency against concurrency.

For each system (target-only, and hetero_spec with the config's draft) and each concurrency level C, C client
threads send requests to one Engine until N requests are done; reported: aggregate generated tokens/s,
per-request latency p50/p95 (submit to last token), time to first token p50, and whether every output equals
the first level's output for that prompt (greedy; the first level is sequential when it is 1). The levels run
one after another on the same Engine; the headline is each level's throughput over the first level's, from
the same run (a ratio, since absolute times drift on a shared machine).
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SYSTEMS = {"target_only": {"draft.kind": "none", "draft.candidates": [], "runtime.mode": "in_process"},
           "hetero_spec": {}}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run_level(engine, prompts: list[list[int]], concurrency: int, max_new: int) -> dict[str, Any]:
    """Serve every prompt once with `concurrency` client threads; token ids per prompt, latencies, throughput."""
    outs: dict[int, list[int]] = {}
    lat, ttft = [], []
    lock = threading.Lock()

    def one(i: int) -> None:
        t0 = time.perf_counter()
        ids: list[int] = []
        first = None
        for chunk in engine.stream_tokens(prompts[i], max_new_tokens=max_new, temperature=0.0):
            if first is None:
                first = time.perf_counter() - t0
            ids.extend(chunk)
        with lock:
            outs[i] = ids
            lat.append(time.perf_counter() - t0)
            ttft.append(first or 0.0)

    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(prompts))))
    wall = time.perf_counter() - t
    tokens = sum(len(v) for v in outs.values())
    return {"concurrency": concurrency, "requests": len(prompts), "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2), "latency_p50_s": round(statistics.median(lat), 4),
            "latency_p95_s": round(_pct(lat, 0.95), 4), "ttft_p50_s": round(statistics.median(ttft), 4),
            "outputs": [outs[i] for i in range(len(prompts))]}


def run_load(config_path: Path, levels: list[int], n_requests: int, max_new: int, out: Path,
             overrides: dict | None = None, say=None) -> dict[str, Any]:
    from ..config import load_config
    from ..engine import Engine
    from .prompts import heldout_prompt_ids

    say = say or (lambda m: print(f"load: {m}", file=sys.stderr, flush=True))
    config = load_config(config_path, overrides=overrides)
    prompts = heldout_prompt_ids(config, Path(config_path), n_requests, 128)
    report: dict[str, Any] = {"config": str(config_path), "requests": n_requests, "max_new_tokens": max_new,
                              "levels": levels, "systems": {}}
    for name, over in SYSTEMS.items():
        say(f"{name}: loading")
        with Engine.from_config(config_path, overrides={**(overrides or {}), **over}) as eng:
            eng.generate(prompts[0], max_new_tokens=16, temperature=0.0)  # warm
            rows = []
            for c in levels:
                say(f"{name}: concurrency {c}, {n_requests} requests")
                rows.append(run_level(eng, prompts, c, max_new))
            ref = rows[0]["outputs"]  # the first level (1 if given) is the sequential reference
            for r in rows:
                r["identical_to_first_level"] = f"{sum(a == b for a, b in zip(r.pop('outputs'), ref))}/{len(ref)}"
                r["throughput_vs_first_level"] = round(r["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
            report["systems"][name] = rows
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps(report, indent=1))
    (out / "load.md").write_text(render(report))
    say(f"wrote {out / 'load.json'} and {out / 'load.md'}")
    return report


def render(report: dict[str, Any]) -> str:
    lines = [f"# hetero-spec load: {report['requests']} requests x {report['max_new_tokens']} tokens per level",
             "", "| system | concurrency | tokens/s | vs first level | latency p50 / p95 (s) | TTFT p50 (s) | "
             "identical |", "|---|---:|---:|---:|---|---:|---:|"]
    for name, rows in report["systems"].items():
        for r in rows:
            lines.append(f"| {name} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
                         f"{r['throughput_vs_first_level']:.2f}x | {r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f}"
                         f" | {r['ttft_p50_s']:.3f} | {r['identical_to_first_level']} |")
    return "\n".join(lines) + "\n"
