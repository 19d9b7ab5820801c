"""Where a verification pass's time goes on this CPU: verify(k), one pass over k + 1 tokens after a cached context,
for k = 0..16 at the context lengths given, on an exported target; then one profiled pass per k, split by ONNX
Runtime's profiler into the LM head, the other MatMulNBits (the projections), attention (GroupQueryAttention) and
the rest; and the host side of a greedy verify (argmax over the [k + 1, vocab] logits).

    python scripts/verify_profile.py --model EXPORT_DIR [--contexts 256,768] [--threads 2] [--reps 15]

EXPORT_DIR: an ONNX export (model.onnx + genai_config.json), e.g. the real pair's int4 target in
$HETERO_SPEC_CACHE/onnx/. Prints a Markdown table per context; times are medians in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from hetero_spec.onnx_decoder import OnnxDecoder


def _median_ms(fn, reps: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def _profiled_session(model_dir: Path, threads: int, prefix: str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.enable_profiling, opts.profile_file_prefix = True, prefix
    return ort.InferenceSession(str(model_dir / "model.onnx"), sess_options=opts, providers=["CPUExecutionProvider"])


def _split(profile: Path, passes: int) -> dict[str, float]:
    """ms per pass by part, from the profiler's node events."""
    parts: dict[str, float] = defaultdict(float)
    for ev in json.loads(profile.read_text()):
        if ev.get("cat") != "Node" or not ev.get("name", "").endswith("_kernel_time"):
            continue
        op, name = ev.get("args", {}).get("op_name", "?"), ev["name"].lower()
        part = ("lm_head" if "lm_head" in name else "matmul" if op in ("MatMulNBits", "MatMul")
                else "attention" if "Attention" in op else "other")
        parts[part] += ev["dur"] / 1e3
    return {k: v / passes for k, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="an ONNX export directory")
    ap.add_argument("--contexts", default="256,768", help="cached context lengths before the block")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--ks", default=",".join(map(str, range(17))), help="draft lengths k (the pass has k + 1)")
    a = ap.parse_args()
    ks = [int(k) for k in a.ks.split(",")]
    dec = OnnxDecoder(a.model, threads=a.threads, spin=False)
    rng = np.random.default_rng(0)
    for ctx in (int(c) for c in a.contexts.split(",")):
        prompt = rng.integers(100, 20000, ctx).tolist()
        state = dec.new_state()
        dec.append(state, prompt)
        rows = []
        for k in ks:
            block = rng.integers(100, 20000, k + 1).tolist()

            def once():
                dec.append(state, block)
                dec.rewind(state, ctx)

            ms = _median_ms(once, a.reps)
            logits = dec.append(state, block)
            dec.rewind(state, ctx)
            argmax = _median_ms(lambda: logits.argmax(axis=-1).tolist(), a.reps)
            rows.append([k, ms, argmax])
        # profiled passes: the same calls on a profiling session swapped in
        real = dec.session
        with tempfile.TemporaryDirectory() as tmp:
            dec.session = _profiled_session(a.model, a.threads, str(Path(tmp) / "p"))
            state = dec.new_state()  # a state's binding belongs to the session it was made with
            dec.append(state, prompt)
            splits = {}
            for k in ks:
                block = rng.integers(100, 20000, k + 1).tolist()
                for _ in range(3):
                    dec.append(state, block)
                    dec.rewind(state, ctx)
            path = Path(dec.session.end_profiling())
            events = json.loads(path.read_text())
            # one profile for all k: split it back by run (each run is a "model_run" event, in order)
            runs = [e for e in events if e.get("name") == "model_run"][1:]  # after the prompt's
            for i, k in enumerate(ks):
                window = runs[3 * i:3 * i + 3]
                t0, t1 = window[0]["ts"], window[-1]["ts"] + window[-1]["dur"]
                sub = [e for e in events if t0 <= e.get("ts", -1) <= t1]
                p = Path(tmp) / f"k{k}.json"
                p.write_text(json.dumps(sub))
                splits[k] = _split(p, 3)
            dec.session = real
        print(f"\n### context {ctx}, {a.threads} threads ({a.model.name})\n")
        print("| k | verify ms | ms over k=0 | LM head ms | projections ms | attention ms | other ms | argmax ms |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        base = rows[0][1]
        for k, ms, argmax in rows:
            s = splits[k]
            print(f"| {k} | {ms:.2f} | {ms - base:+.2f} | {s.get('lm_head', 0):.2f} | {s.get('matmul', 0):.2f} | "
                  f"{s.get('attention', 0):.2f} | {s.get('other', 0):.2f} | {argmax:.3f} |")


if __name__ == "__main__":
    main()
