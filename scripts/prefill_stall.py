"""How long a long prompt arriving stalls the streams already decoding, with and without chunked prefill
(serving.prefill_chunk). Three streams decode; once each has its first tokens, a long prompt arrives. For each
setting (interleaved, every repeat runs each once): the longest wait between two of a running stream's rounds
while the long prompt is cached, the median wait of the rest of their rounds, and the long request's time to first
token. Prints a markdown table (docs/benchmarks.md, "Chunked prefill").

    .venv/bin/python scripts/prefill_stall.py --config configs/cpu-demo.yaml --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHORT = ["def parse(", "import os\n", "class Stack:"]


def one_run(eng, long_prompt: list[int], new_tokens: int) -> dict[str, float]:
    """Three streams, then the long prompt: the running streams' round gaps (ms) and the long one's TTFT (ms)."""
    arrivals: list[list[float]] = [[] for _ in SHORT]
    started = threading.Barrier(len(SHORT) + 1)

    def stream(i: int) -> None:
        first = True
        for _ in eng.stream_tokens(SHORT[i], max_new_tokens=new_tokens, temperature=0.0):
            arrivals[i].append(time.perf_counter())
            if first:
                first = False
                started.wait()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(SHORT))]
    for t in threads:
        t.start()
    started.wait()  # every stream decodes
    t_long = time.perf_counter()
    it = eng.stream_tokens(long_prompt, max_new_tokens=4, temperature=0.0)
    next(it)
    ttft = time.perf_counter() - t_long
    for _ in it:
        pass
    for t in threads:
        t.join()
    during, rest = [], []
    for times in arrivals:
        for a, b in zip(times, times[1:]):
            (during if a <= t_long + ttft and b >= t_long else rest).append(b - a)
    return {"max_gap_ms": 1e3 * max(during, default=0.0), "median_gap_ms": 1e3 * (statistics.median(rest) if rest else 0.0),
            "ttft_ms": 1e3 * ttft}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "cpu-demo.yaml"))
    ap.add_argument("--long", type=int, default=900, help="tokens of the long prompt (default 900)")
    ap.add_argument("--chunks", default="0,256", help="serving.prefill_chunk settings (0: whole; default 0,256)")
    ap.add_argument("--new-tokens", type=int, default=96, help="tokens per running stream (default 96)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from hetero_spec import Engine

    chunks = [int(c) for c in args.chunks.split(",")]
    overrides = {"serving.max_batch": 4, "runtime.mode": "in_process"}
    runs: dict[int, list[dict[str, float]]] = {c: [] for c in chunks}
    long_prompt: list[int] = []
    for r in range(args.repeats):
        for c in (chunks if r % 2 == 0 else chunks[::-1]):  # one Engine at a time: none shares the cores
            with Engine.from_config(args.config, overrides={**overrides, "serving.prefill_chunk": c}) as eng:
                if not long_prompt:
                    text = (ROOT / "hetero_spec" / "scheduler.py").read_text()
                    long_prompt = eng.prompt_ids(text)[:args.long]
                one_run(eng, long_prompt, 8)  # warm-up
                runs[c].append(one_run(eng, long_prompt, args.new_tokens))
            print(f"repeat {r + 1}, prefill_chunk {c}: {runs[c][-1]}", file=sys.stderr, flush=True)
    med = {c: {k: statistics.median(run[k] for run in runs[c]) for k in runs[c][0]} for c in chunks}
    print(f"| `serving.prefill_chunk` | longest wait of a running stream while the {len(long_prompt)}-token prompt "
          "is cached (ms) | their other rounds, median (ms) | the long request's time to first token (ms) |")
    print("|---|---:|---:|---:|")
    for c in chunks:
        m = med[c]
        print(f"| {c if c else '0 (whole)'} | {m['max_gap_ms']:.1f} | {m['median_gap_ms']:.1f} | {m['ttft_ms']:.1f} |")
    print(f"\nmedians over {args.repeats} interleaved repeats; {args.config}, 3 greedy streams of {args.new_tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
