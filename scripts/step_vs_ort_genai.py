"""Per-token decode time of our target alone against ONNX Runtime GenAI's plain loop on the same ONNX export, in one
process: our runner's greedy steps in a tight loop (`OnnxDecoder.greedy_steps`), the whole Engine (target alone,
greedy), and ORT GenAI's generate_next_token loop. Interleaved per prompt, each run after the cores settle; medians
of the timed repeats (the first is a warm-up). Prefill is not timed.

--genai-first loads ORT GenAI's model before ours. Which of the two large sessions a process loads first moves the
result by a few percent (docs/benchmarks.md), so run both orders. In one process each engine also runs on caches
the other's copy of the weights has just evicted; --separate N runs each side in a process of its own instead, N
rounds, the order alternating, and pairs the two per round.

Usage: python scripts/step_vs_ort_genai.py [--config configs/cpu-demo.yaml] [--tokens 64] [--threads 2]
       [--genai-first | --separate N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
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
    ap.add_argument("--separate", type=int, default=0, metavar="N",
                    help="N rounds of two processes (ours, then ORT GenAI, the order alternating)")
    ap.add_argument("--only", choices=["ours", "genai"], help=argparse.SUPPRESS)  # a --separate child
    ap.add_argument("--job", help=argparse.SUPPRESS)  # the child's JSON: export folder and prompt ids
    args = ap.parse_args()
    if args.separate:
        return separate(args)

    import onnxruntime_genai as og

    from hetero_spec import Engine
    from hetero_spec.bench.harness import ALONE, quiesce

    overrides = {**ALONE, "runtime.cpus": None, "target.threads": args.threads}
    session_options = json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": args.threads}}}})

    def genai_model(model_dir: Path):
        config = og.Config(str(model_dir))
        config.overlay(session_options)
        return og.Model(config)

    n = args.tokens
    if args.only == "genai":  # a --separate child: ORT GenAI alone in this process
        job = json.loads(args.job)
        genai, prompts, eng = genai_model(Path(job["export_dir"])), job["prompts"], None
    else:
        if args.genai_first:  # the export's folder is known only once the config resolves: a throwaway engine finds it
            with Engine.from_config(args.config, overrides={**overrides, "target.threads": 1}) as probe:
                export_dir = probe.target.decoder.model_dir
            genai = genai_model(export_dir)
        eng = Engine.from_config(args.config, overrides=overrides)
        if eng.target.backend != "onnx":
            sys.exit("the config's target must use the onnx backend (target.backend: onnx)")
        dec = eng.target.decoder
        if not args.genai_first and args.only is None:
            genai = genai_model(dec.model_dir)
        prompts = [eng.prompt_ids(p) for p in PROMPTS]

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
    if args.only:
        systems = {"ORT GenAI": ort_genai} if args.only == "genai" else {k: systems[k] for k in list(systems)[:2]}
    times: dict[str, list[float]] = {name: [] for name in systems}
    for rep in range(args.repeats):
        for p in prompts:
            for name, run in systems.items():
                quiesce()
                seconds = run(p)
                if rep:
                    times[name].append(seconds)
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    if eng is not None:
        eng.close()
    if args.only:  # a --separate child: its medians and, from ours, what the GenAI child needs
        out = {name: statistics.median(values) for name, values in times.items()}
        if eng is not None:
            out["job"] = {"export_dir": str(dec.model_dir), "prompts": prompts}
        print(json.dumps(out))
        return 0
    peer = statistics.median(times["ORT GenAI"])
    print(f"{'system':28s} {'ms/token':>9s} {'ORT GenAI / this':>17s}   (loaded first: "
          f"{'ORT GenAI' if args.genai_first else 'ours'})")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:28s} {median * 1e3:9.3f} {peer / median:16.3f}x")
    return 0


def separate(args) -> int:
    """--separate: each side in a process of its own, N rounds, the order alternating; ratios paired per round."""
    base = [sys.executable, __file__, "--config", args.config, "--tokens", str(args.tokens), "--threads",
            str(args.threads), "--repeats", str(args.repeats)]

    def child(side: str, job: dict | None) -> dict:
        extra = ["--job", json.dumps(job)] if job else []
        done = subprocess.run([*base, "--only", side, *extra], capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"the {side} process failed:\n{done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = child("ours", None)  # also finds the export and the prompts' ids
    job, rounds = first.pop("job"), []
    for r in range(args.separate):
        if r % 2 == 0:
            ours = first if r == 0 else child("ours", None)
            genai = child("genai", job)
        else:
            genai = child("genai", job)
            ours = child("ours", None)
        ours.pop("job", None)
        rounds.append({**ours, **genai})
        print(f"round {r + 1}/{args.separate}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in rounds[-1].items()),
              file=sys.stderr)
    print(f"{'system':28s} {'ms/token':>9s} {'ORT GenAI / this, paired per round (range)':>44s}   (separate processes)")
    for name in rounds[0]:
        ratios = [r["ORT GenAI"] / r[name] for r in rounds]
        print(f"{name:28s} {statistics.median(r[name] for r in rounds) * 1e3:9.3f} "
              f"{statistics.median(ratios):16.3f}x ({min(ratios):.3f}-{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
