"""Per-run cost of the shared ONNX decoder runner against context length, shared vs copy layout.

Usage: python scripts/decoder_cost.py --model DIR [--model DIR ...] [--contexts 128,512,1000] [--k 1,9]
Prints a Markdown table of median milliseconds per run of k tokens after a cached context, both layouts
interleaved (the ratio is what to read on a noisy machine).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from hetero_spec.onnx_decoder import OnnxDecoder


def cost_ms(dec: OnnxDecoder, ctx: int, k: int, reps: int) -> float:
    st = dec.new_state()
    dec.append(st, [(7 * i) % 200 + 10 for i in range(ctx)])
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dec.append(st, [5] * k)
        times.append(time.perf_counter() - t)
        dec.rewind(st, ctx)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="exported decoder directory (repeatable)")
    ap.add_argument("--contexts", default="128,512,1000")
    ap.add_argument("--k", default="1,9", help="tokens per run (1: a draft step; 9: a verify of 8 drafts)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    print("| model | context | k | copy layout (ms) | shared layout (ms) | shared / copy |")
    print("|---|---:|---:|---:|---:|---:|")
    for m in a.model:
        shared = OnnxDecoder(Path(m), threads=a.threads, shared_buffer=True)
        copy = OnnxDecoder(Path(m), threads=a.threads, shared_buffer=False)
        for ctx in map(int, a.contexts.split(",")):
            for k in map(int, a.k.split(",")):
                c, s = cost_ms(copy, ctx, k, a.reps), cost_ms(shared, ctx, k, a.reps)
                print(f"| {Path(m).name} | {ctx} | {k} | {c:.2f} | {s:.2f} | {s / c:.2f} |", flush=True)


if __name__ == "__main__":
    main()
