"""Per-token decode time of our target alone against ONNX Runtime GenAI's plain loop on the same ONNX export, in one
process: our runner's greedy steps in a tight loop (`OnnxDecoder.greedy_steps`), the whole Engine (target alone,
greedy), and ORT GenAI's generate_next_token loop. Interleaved per prompt, each run after the cores settle; medians
of the timed repeats (the first is a warm-up). Prefill is not timed.

--genai-first loads ORT GenAI's model before ours. Which of the two large sessions a process loads first moves the
result by a few percent (docs/benchmarks.md), so run both orders.

Usage: python scripts/step_vs_ort_genai.py [--config configs/cpu-demo.yaml] [--tokens 64] [--threads 2]
       [--genai-first]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n", "class Stack:\n    def"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "cpu-demo.yaml"))
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=4, help="runs per prompt and system, the first untimed")
    ap.add_argument("--genai-first", action="store_true", help="load ORT GenAI's model before ours")
    args = ap.parse_args()

    import onnxruntime_genai as og

    from hetero_spec import Engine
    from hetero_spec.bench.harness import ALONE, quiesce

    overrides = {**ALONE, "runtime.cpus": None, "target.threads": args.threads}
    session_options = json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": args.threads}}}})

    def genai_model(model_dir: Path):
        config = og.Config(str(model_dir))
        config.overlay(session_options)
        return og.Model(config)

    if args.genai_first:  # the export's folder is known only once the config resolves: a throwaway engine finds it
        with Engine.from_config(args.config, overrides={**overrides, "target.threads": 1}) as probe:
            export_dir = probe.target.decoder.model_dir
        genai = genai_model(export_dir)
    eng = Engine.from_config(args.config, overrides=overrides)
    if eng.target.backend != "onnx":
        sys.exit("the config's target must use the onnx backend (target.backend: onnx)")
    dec = eng.target.decoder
    if not args.genai_first:
        genai = genai_model(dec.model_dir)
    prompts, n = [eng.prompt_ids(p) for p in PROMPTS], args.tokens

    def ours(p: list[int]) -> float:
        state = eng.target.new_state()
        dec.append(state, p[:-1], last_only=True)
        started = time.perf_counter()
        dec.greedy_steps(state, p[-1], n)
        seconds = time.perf_counter() - started
        eng.target.release_state(state)
        return seconds / n

    def engine(p: list[int]) -> float:
        stats = eng.generate(p, max_new_tokens=n + 1, temperature=0.0, ignore_eos=True).stats
        return (stats["time_total_s"] - stats["time_prefill_s"]) / (n + 1)

    def ort_genai(p: list[int]) -> float:
        params = og.GeneratorParams(genai)
        params.set_search_options(max_length=len(p) + n + 1, min_length=len(p) + n + 1, do_sample=False)
        gen = og.Generator(genai, params)
        gen.append_tokens(p)
        gen.generate_next_token()  # the prompt's token
        started = time.perf_counter()
        for _ in range(n - 1):
            gen.generate_next_token()
        return (time.perf_counter() - started) / (n - 1)

    systems = {"our runner's steps": ours, "our Engine (target alone)": engine, "ORT GenAI": ort_genai}
    times: dict[str, list[float]] = {name: [] for name in systems}
    for rep in range(args.repeats):
        for p in prompts:
            for name, run in systems.items():
                quiesce()
                seconds = run(p)
                if rep:
                    times[name].append(seconds)
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    eng.close()
    peer = statistics.median(times["ORT GenAI"])
    print(f"{'system':28s} {'ms/token':>9s} {'ORT GenAI / this':>17s}   (loaded first: "
          f"{'ORT GenAI' if args.genai_first else 'ours'})")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:28s} {median * 1e3:9.3f} {peer / median:16.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
