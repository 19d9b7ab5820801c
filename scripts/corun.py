"""What two decoders on two cores cost each other: the target's step and the draft's token, each alone
on its own core, and both at once (the two-process layout's situation), in interleaved repeats.

Usage: python scripts/corun.py [--target-precision int8] [--draft models/draft] [--draft-precision int8] [--seconds 3]
       [--repeats 4] [--target-block K]
Needs 2 cores. Prints a Markdown table of median ms per step after a 128-token prompt: the draft steps one
token at a time, the target K tokens at a time (1: decoding; 4: verifying 3 drafts; 128: a prefill).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path


def _decode(model: str, role: str, core: int, seconds: float, start, out, block: int = 1) -> None:
    os.sched_setaffinity(0, {core})
    from hetero_spec.onnx_decoder import OnnxDecoder

    dec = OnnxDecoder(Path(model), threads=1, role=role)
    prompt = [(7 * i) % 200 + 10 for i in range(128)]
    st = dec.new_state()
    dec.append(st, prompt)
    start.wait()  # both begin together
    times, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        if st.n_past >= 240:
            dec.rewind(st, 128)
        t = time.perf_counter()
        dec.append(st, [11] * block)
        times.append(time.perf_counter() - t)
        if block > 1:  # keep one position, as a verification that accepts nothing does
            dec.rewind(st, st.n_past - block + 1)
    out.put((role, 1e3 * statistics.median(times)))


def run(arms: list[tuple[str, str, int, int]], seconds: float) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(len(arms)), ctx.Queue()
    procs = [ctx.Process(target=_decode, args=(m, role, core, seconds, start, out, block))
             for m, role, core, block in arms]
    for p in procs:
        p.start()
    got = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="models/target", help="target checkpoint (exported and cached as needed)")
    p.add_argument("--target-precision", default="int8")
    p.add_argument("--draft", default="models/draft", help="draft checkpoint (exported and cached as needed), or "
                   "an exported ONNX draft directory")
    p.add_argument("--draft-precision", default="int8")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--target-block", type=int, default=1, help="tokens per target step (1, 4, 128, ...)")
    args = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 cores")
    from hetero_spec.target.export_cache import cached_export

    target = str(cached_export(Path(args.target), args.target_precision))
    draft = Path(args.draft)
    draft = str(draft if (draft / "model.onnx").is_file() else cached_export(draft, args.draft_precision, role="draft"))
    cores = sorted(os.sched_getaffinity(0))[:2]
    t_arm, d_arm = (target, "target", cores[0], args.target_block), (draft, "draft", cores[1], 1)
    res: dict[str, list[float]] = {k: [] for k in ("target alone", "draft alone", "target, both", "draft, both")}
    for rep in range(args.repeats):
        plans = [("alone", [t_arm]), ("alone", [d_arm]), ("both", [t_arm, d_arm])]
        for kind, arms in plans[rep % 3:] + plans[:rep % 3]:
            for role, ms in run(arms, args.seconds).items():
                res[f"{role} {kind}" if kind == "alone" else f"{role}, both"].append(ms)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"target {args.target_precision} ({target}) on core {cores[0]}, {args.target_block} token(s) a step; "
          f"draft {args.draft} on core {cores[1]}; 1 thread each; medians of {args.repeats} interleaved repeats "
          f"of {args.seconds:g} s\n")
    print("| decoder | alone (ms/step) | both at once (ms/step) | slowdown |")
    print("|---|---:|---:|---:|")
    for role in ("target", "draft"):
        a, b = med[f"{role} alone"], med[f"{role}, both"]
        print(f"| {role} | {a:.3f} | {b:.3f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
