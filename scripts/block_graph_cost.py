"""What a verified block of k tokens costs on each of the target's graphs: its export at target.precision and its block
graph (target.block_graph: int8, made once into the cache), each in a decoder of its own over the same context, the
graphs and lengths in turn (interleaved), medians of --reps. A block of k on the pair costs min of the two; the
table gives it against the fastest single step (the target graph's V(1)).

    python scripts/block_graph_cost.py --config configs/qwen2.5-coder-1.5b.yaml [--ks 1,2,3,4,6,8,12,16] \\
        [--reps 7] [--context 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero_spec.config import load_config  # noqa: E402
from hetero_spec.gguf_source import resolve  # noqa: E402
from hetero_spec.onnx_decoder import OnnxDecoder  # noqa: E402
from hetero_spec.precision import check_target  # noqa: E402
from hetero_spec.target.backends import onnx_model_dir  # noqa: E402
from hetero_spec.target.export_cache import cached_block_export  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--ks", default="1,2,3,4,6,8,12,16", help="block lengths (tokens in one pass)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--context", type=int, default=128, help="tokens cached before each block")
    args = p.parse_args()
    cfg = resolve(load_config(args.config))
    cfg.target.precision = check_target(cfg, "onnx", False)
    threads = cfg.target.threads or 1
    graphs = {f"{cfg.target.precision} (target.precision)": onnx_model_dir(cfg.target),
              "int8 block graph": cached_block_export(cfg.target.model)}
    decoders = {name: OnnxDecoder(path, threads=threads, role="target") for name, path in graphs.items()}
    ks = [int(k) for k in args.ks.split(",")]
    states = {}
    for name, dec in decoders.items():
        states[name] = dec.new_state()
        dec.append(states[name], [(3 + i) % dec.model_vocab for i in range(args.context)], last_only=True)
    times = {(name, k): [] for name in decoders for k in ks}
    for rep in range(args.reps + 1):  # the first round warms up (not counted)
        for k in ks:
            for name, dec in decoders.items():
                started = time.perf_counter()
                dec.append(states[name], [5] * k)
                if rep:
                    times[name, k].append(time.perf_counter() - started)
                dec.rewind(states[name], args.context)
        print(f"round {rep}/{args.reps} done", file=sys.stderr)
    med = {key: statistics.median(v) for key, v in times.items()}
    first, block = list(decoders)
    step = med[first, ks[0]]
    print(f"{cfg.target.model.name}, {threads} threads, {args.context} tokens cached, median of {args.reps}\n")
    print(f"| k | {first} ms | {block} ms | the faster / the fastest single step |")
    print("|---:|---:|---:|---:|")
    for k in ks:
        a, b = med[first, k], med[block, k]
        print(f"| {k} | {a * 1e3:.1f} | {b * 1e3:.1f} | {min(a, b) / step:.2f} ({'block' if b < a else 'target'}) |")


if __name__ == "__main__":
    main()
