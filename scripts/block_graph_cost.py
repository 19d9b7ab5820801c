"""What a verified block of k tokens costs on each of the target's graphs, each in a decoder of its own over the same
context, the graphs and lengths in turn (interleaved), medians of --reps:
  onnxruntime   the export at target.precision, its 4-bit matmuls on ONNX Runtime's MatMulNBits
  hetero_spec   the same export on hetero_spec's Q4Rows (runtime.kernels: hetero_spec)
  int8-block    the int8 block graph (target.block_graph: int8, made once into the cache from the fp32 export)
The table gives each graph's times, and the fastest of them against the fastest single step (k = 1 on any graph).

    python scripts/block_graph_cost.py --config configs/qwen2.5-coder-1.5b.yaml [--graphs onnxruntime,int8-block] \\
        [--ks 1,2,3,4,6,8,12,16] [--reps 7] [--context 128]
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
    p.add_argument("--graphs", default="onnxruntime,int8-block",
                   help="comma-separated: onnxruntime, hetero_spec, int8-block")
    p.add_argument("--ks", default="1,2,3,4,6,8,12,16", help="block lengths (tokens in one pass)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--context", type=int, default=128, help="tokens cached before each block")
    args = p.parse_args()
    cfg = resolve(load_config(args.config))
    cfg.target.precision = check_target(cfg, "onnx", False)
    threads = cfg.target.threads or 1
    decoders = {}
    for name in args.graphs.split(","):
        if name in ("onnxruntime", "hetero_spec"):
            decoders[name] = OnnxDecoder(onnx_model_dir(cfg.target), threads=threads, role="target", kernels=name)
        elif name == "int8-block":
            decoders[name] = OnnxDecoder(cached_block_export(cfg.target.model), threads=threads, role="target")
        else:
            p.error(f"--graphs: unknown graph {name!r}")
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
    names = list(decoders)
    step = min(med[name, ks[0]] for name in names)
    print(f"{cfg.target.model.name} at {cfg.target.precision}, {threads} threads, {args.context} tokens cached, "
          f"median of {args.reps}\n")
    print("| k | " + " | ".join(f"{name} ms" for name in names) + " | the fastest / the fastest single step |")
    print("|---:|" + "---:|" * (len(names) + 1))
    for k in ks:
        best = min(names, key=lambda name: med[name, k])
        print(f"| {k} | " + " | ".join(f"{med[name, k] * 1e3:.1f}" for name in names)
              + f" | {med[best, k] / step:.2f} ({best}) |")


if __name__ == "__main__":
    main()
