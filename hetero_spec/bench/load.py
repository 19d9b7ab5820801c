"""`hetero-spec load`: aggregate throughput and per-request latency against concurrency.

For each system (target-only, and hetero_spec with the config's draft) and each concurrency level C, C client
threads send requests to one Engine until N requests are done; the Engine's request scheduler decodes up to
serving.max_batch of them together. Reported: aggregate generated tokens/s, per-request latency p50/p95
(submit to last token), time to first token p50, and whether every output equals the first level's output for
that prompt (greedy; the first level is sequential when it is 1).

Both Engines are loaded at once and the (system, level) runs are interleaved, repeat after repeat, in a rotating
order; the headline is each level's throughput over the first level's of the same system, paired per repeat
(the median of the ratios), since absolute times drift on a shared machine.
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
             overrides: dict | None = None, say=None, repeats: int = 3) -> dict[str, Any]:
    from contextlib import ExitStack

    from ..config import load_config
    from ..engine import Engine
    from .prompts import heldout_prompt_ids

    say = say or (lambda m: print(f"load: {m}", file=sys.stderr, flush=True))
    config = load_config(config_path, overrides=overrides)
    prompts = heldout_prompt_ids(config, Path(config_path), n_requests, 128)
    report: dict[str, Any] = {"config": str(config_path), "requests": n_requests, "max_new_tokens": max_new,
                              "levels": levels, "repeats": repeats, "systems": {}}
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {(n, c): [] for n in SYSTEMS for c in levels}
    with ExitStack() as stack:
        engines = {}
        for name, over in SYSTEMS.items():
            say(f"{name}: loading")
            engines[name] = stack.enter_context(Engine.from_config(config_path,
                                                                   overrides={**(overrides or {}), **over}))
            engines[name].generate(prompts[0], max_new_tokens=16, temperature=0.0)  # warm
            report.setdefault("layouts", {})[name] = engines[name].config.runtime.mode
        order = [(n, c) for c in levels for n in SYSTEMS]
        for rep in range(repeats):
            rot = rep % len(order)
            for name, c in order[rot:] + order[:rot]:
                say(f"repeat {rep + 1}/{repeats}: {name}, concurrency {c}, {n_requests} requests")
                runs[(name, c)].append(run_level(engines[name], prompts, c, max_new))
    for name in SYSTEMS:
        report["systems"][name] = [_summarise(runs, name, c, levels[0]) for c in levels]
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps(report, indent=1))
    (out / "load.md").write_text(render(report))
    say(f"wrote {out / 'load.json'} and {out / 'load.md'}")
    return report


def _summarise(runs: dict, name: str, c: int, first: int) -> dict[str, Any]:
    """One (system, level): medians over the repeats, the ratio to the first level paired per repeat, and how
    many outputs equal the first level's (every repeat, every prompt)."""
    mine, base = runs[(name, c)], runs[(name, first)]
    ref = base[0]["outputs"]
    same = sum(a == b for r in mine for a, b in zip(r["outputs"], ref))
    med = {k: round(statistics.median(r[k] for r in mine), 4)
           for k in ("tokens_per_s", "latency_p50_s", "latency_p95_s", "ttft_p50_s", "wall_s")}
    ratio = statistics.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(mine, base))
    return {"concurrency": c, "requests": mine[0]["requests"], "tokens": mine[0]["tokens"], **med,
            "throughput_vs_first_level": round(ratio, 3),
            "identical_to_first_level": f"{same}/{len(ref) * len(mine)}"}


def render(report: dict[str, Any]) -> str:
    lines = [f"# hetero-spec load: {report['requests']} requests x {report['max_new_tokens']} tokens per level"
             + (f", medians of {report['repeats']} interleaved repeats" if report.get("repeats") else ""),
             "", "| system | concurrency | tokens/s | vs first level | latency p50 / p95 (s) | TTFT p50 (s) | "
             "identical |", "|---|---:|---:|---:|---|---:|---:|"]
    for name, rows in report["systems"].items():
        for r in rows:
            lines.append(f"| {name} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
                         f"{r['throughput_vs_first_level']:.2f}x | {r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f}"
                         f" | {r['ttft_p50_s']:.3f} | {r['identical_to_first_level']} |")
    return "\n".join(lines) + "\n"
