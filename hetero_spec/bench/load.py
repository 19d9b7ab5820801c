"""`hetero-spec load` (docs/benchmarks.md): at level C, C client threads send the held-out prompts to one Engine;
the (system, level) runs rotate over the repeats (`interleave`), each paired per repeat with the first level's."""

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .harness import ALONE, interleave, table, write_report

SYSTEMS = {"target_only": ALONE, "hetero_spec": {}}


def run_level(engine, prompts: list[list[int]], concurrency: int, max_new: int) -> dict[str, Any]:
    """Serve every prompt once with `concurrency` client threads: outputs, latencies, throughput."""

    def one(prompt: list[int]) -> tuple[list[int], float, float]:  # (token ids, latency, time to first token)
        started, ids, first = time.perf_counter(), [], None
        for chunk in engine.stream_tokens(prompt, max_new_tokens=max_new, temperature=0.0):
            first = time.perf_counter() - started if first is None else first
            ids.extend(chunk)
        return ids, time.perf_counter() - started, first or 0.0

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outputs, latencies, ttfts = zip(*pool.map(one, prompts))
    wall, tokens = time.perf_counter() - started, sum(map(len, outputs))
    return {"concurrency": concurrency, "requests": len(prompts), "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2), "latency_p50_s": round(statistics.median(latencies), 4),
            "latency_p95_s": round(sorted(latencies)[round(0.95 * (len(latencies) - 1))], 4),
            "ttft_p50_s": round(statistics.median(ttfts), 4), "outputs": list(outputs)}


def run_load(config_path: Path, levels: list[int], n_requests: int, max_new: int, out: Path,
             overrides: dict | None = None, say=None, repeats: int = 3) -> dict[str, Any]:
    """Measure every (system, level) `repeats` times, interleaved; write OUT/load.json and OUT/load.md."""
    from contextlib import ExitStack
    from ..config import load_config
    from ..engine import Engine
    from .prompts import heldout_prompt_ids
    say, overrides = say or (lambda m: print(f"load: {m}", file=sys.stderr, flush=True)), overrides or {}
    config = load_config(config_path, overrides=overrides)
    prompts = heldout_prompt_ids(config, Path(config_path), n_requests, 128)
    report: dict[str, Any] = {"config": str(config_path), "requests": n_requests, "max_new_tokens": max_new,
                              "levels": levels, "repeats": repeats, "layouts": {}, "systems": {}}
    with ExitStack() as stack:
        engines = {}
        for name, extra in SYSTEMS.items():
            say(f"{name}: loading")
            engines[name] = stack.enter_context(Engine.from_config(config_path, overrides={**overrides, **extra}))
            engines[name].generate(prompts[0], max_new_tokens=16, temperature=0.0)  # warm
            report["layouts"][name] = engines[name].config.runtime.mode

        def run(key: tuple[str, int], _) -> dict[str, Any]:
            name, level = key
            say(f"{name}, concurrency {level}, {n_requests} requests")
            return run_level(engines[name], prompts, level, max_new)

        keys = [(name, level) for level in levels for name in SYSTEMS]
        runs, _ = interleave(keys, [None] * repeats, 1, run, must=keys)  # one "prompt" per repeat: rotating
    for name, level in keys:  # medians over the repeats; the first level's first repeat is the outputs' reference
        mine, base = ([r[0][1] for r in runs[(name, lv)]] for lv in (level, levels[0]))
        same = sum(a == b for r in mine for a, b in zip(r["outputs"], base[0]["outputs"]))
        report["systems"].setdefault(name, []).append({
            "concurrency": level, "requests": n_requests, "tokens": mine[0]["tokens"],
            **{k: round(statistics.median(r[k] for r in mine), 4)
               for k in ("tokens_per_s", "latency_p50_s", "latency_p95_s", "ttft_p50_s", "wall_s")},
            "throughput_vs_first_level": round(statistics.median(r["tokens_per_s"] / b["tokens_per_s"]
                                                                 for r, b in zip(mine, base)), 3),
            "identical_to_first_level": f"{same}/{len(base[0]['outputs']) * len(mine)}"})
    write_report(Path(out), "load", report, render(report))
    say(f"wrote {Path(out) / 'load.json'} and {Path(out) / 'load.md'}")
    return report


def render(report: dict[str, Any]) -> str:
    rows = [[name, r["concurrency"], f"{r['tokens_per_s']:.1f}", f"{r['throughput_vs_first_level']:.2f}x",
             f"{r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f}", f"{r['ttft_p50_s']:.3f}",
             r["identical_to_first_level"]] for name, rs in report["systems"].items() for r in rs]
    return "\n".join([f"# hetero-spec load: {report['requests']} requests x {report['max_new_tokens']} tokens per "
                      f"level, medians of {report.get('repeats', 1)} interleaved repeats", "",
                      *table(["system", "concurrency", "tokens/s", "vs first level", "latency p50 / p95 (s)",
                              "TTFT p50 (s)", "identical"], rows)]) + "\n"
