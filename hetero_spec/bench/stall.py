"""`hetero-spec bench --scenario prefill-stall`: what a long prompt arriving costs the streams already decoding, per
serving.prefill_chunk setting and with no long prompt at all. Three greedy streams decode; once each has its first
tokens, a long prompt arrives (or, in the "none" arm, nothing does). Per arm (one Engine at a time, the order
rotating per repeat): a running stream's longest wait for its next tokens, the median of its waits, and the long
request's time to first token; medians over the repeats. Writes OUT/prefill_stall.json and .md."""

import statistics
import threading
import time
from pathlib import Path
from typing import Any

SHORT = ["def parse(", "import os\n", "class Stack:"]
LONG_TEXT = Path(__file__).resolve().parents[1] / "scheduler.py"  # code, as a long prompt would be
NONE = "none"


def one_run(engine, long_prompt: list[int] | None, new_tokens: int) -> dict[str, float]:
    """Three streams, then the long prompt (None: no arrival): the streams' waits (ms), the long one's TTFT (ms)."""
    arrivals: list[list[float]] = [[] for _ in SHORT]
    started = threading.Barrier(len(SHORT) + 1)

    def stream(index: int) -> None:
        for tokens in engine.stream_tokens(SHORT[index], max_new_tokens=new_tokens, temperature=0.0):
            arrivals[index].append(time.perf_counter())
            if len(arrivals[index]) == 1:
                started.wait()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(SHORT))]
    for thread in threads:
        thread.start()
    started.wait()  # every stream decodes
    ttft = 0.0
    if long_prompt is not None:
        arrived = time.perf_counter()
        tokens = engine.stream_tokens(long_prompt, max_new_tokens=4, temperature=0.0)
        next(tokens)
        ttft = time.perf_counter() - arrived
        list(tokens)  # the rest of its stream
    for thread in threads:
        thread.join()
    waits = [later - earlier for times in arrivals for earlier, later in zip(times, times[1:])]
    return {"longest_wait_ms": 1e3 * max(waits, default=0.0), "median_wait_ms": 1e3 * statistics.median(waits or [0]),
            "long_ttft_ms": 1e3 * ttft}


def run_stall(config: Path, overrides: dict[str, Any], out: Path, chunks: list[int], long_tokens: int,
              new_tokens: int, repeats: int, say=print) -> dict[str, Any]:
    """Every arm (NONE, then each chunk setting) once per repeat, interleaved; the medians per arm."""
    from ..engine import Engine
    from .harness import write_report

    arms: list[int | str] = [NONE, *chunks]
    runs: dict[int | str, list[dict[str, float]]] = {arm: [] for arm in arms}
    long_prompt: list[int] = []
    base = {**overrides, "serving.max_batch": max(4, overrides.get("serving.max_batch", 4))}
    for repeat in range(repeats):
        for arm in arms[repeat % len(arms):] + arms[:repeat % len(arms)]:
            chunk = chunks[0] if arm == NONE else arm
            with Engine.from_config(config, overrides={**base, "serving.prefill_chunk": chunk}) as engine:
                fits = min(long_tokens, engine.target.context_len - 8)  # room for its 4 tokens
                long_prompt = long_prompt or engine.prompt_ids(LONG_TEXT.read_text())[:fits]
                one_run(engine, long_prompt, 4)  # warm-up
                runs[arm].append(one_run(engine, None if arm == NONE else long_prompt, new_tokens))
            say(f"[prefill-stall: repeat {repeat + 1}/{repeats}, {arm}: {runs[arm][-1]}]")
    medians = {str(arm): {key: statistics.median(run[key] for run in runs[arm]) for key in runs[arm][0]}
               for arm in arms}
    report = {"config": str(config), "long_prompt_tokens": len(long_prompt), "streams": len(SHORT),
              "new_tokens": new_tokens, "repeats": repeats, "medians": medians,
              "runs": {str(arm): runs[arm] for arm in arms}}
    write_report(out, "prefill_stall", report, render(report))
    return report


def render(report: dict[str, Any]) -> str:
    lines = [f"| long prompt ({report['long_prompt_tokens']} tokens), `serving.prefill_chunk` | a running stream's "
             "longest wait (ms) | its median wait (ms) | the long request's time to first token (ms) |",
             "|---|---:|---:|---:|"]
    for arm, row in report["medians"].items():
        name = "none arrives" if arm == NONE else f"arrives, {arm if arm != '0' else '0 (whole)'}"
        ttft = "" if arm == NONE else f"{row['long_ttft_ms']:.1f}"
        lines.append(f"| {name} | {row['longest_wait_ms']:.1f} | {row['median_wait_ms']:.1f} | {ttft} |")
    lines.append(f"\n{report['streams']} greedy streams of {report['new_tokens']} tokens, {report['config']}; "
                 f"medians over {report['repeats']} interleaved repeats, one Engine at a time")
    return "\n".join(lines) + "\n"
