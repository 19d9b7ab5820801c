"""Arms of one config compared with each arm's Engine in a process of its own (no other engine's pool threads in
it), the arms run in turn, the order rotating, for --rounds rounds. Each run: two untimed warm-up prompts, then
--prompts held-out prompts x --repeats, greedy; a prompt's time is the median of its repeats. Prints, per arm,
the median over prompts of its time / the first arm's (both the medians of every round), each round's ratio, and
the loop's time per round by phase.

    python scripts/separate_runs.py --config configs/cpu-demo.yaml \\
        --arm 'alone=draft.kind=none' --arm 'run=runtime.mode=in_process' \\
        --arm 'true=runtime.mode=in_process,target.spin=true'
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("time_prefill_s", "time_draft_s", "time_verify_s", "time_idle_s")


def one_run(config: str, sets: list[str], prompts: int, repeats: int, max_new: int) -> dict:
    """In the child process: one Engine, its per-prompt times and its time per round by phase."""
    sys.path.insert(0, str(ROOT))
    from hetero_spec.bench.prompts import heldout_prompt_ids
    from hetero_spec.config import load_config, parse_override
    from hetero_spec.engine import Engine
    overrides = dict(parse_override(s) for s in sets)
    ids = heldout_prompt_ids(load_config(config), Path(config), prompts + 2, 128)
    times, phases, rounds = [[] for _ in range(prompts)], dict.fromkeys(PHASES, 0.0), 0
    with Engine.from_config(config, overrides=overrides) as engine:
        for warm in ids[:2]:
            engine.generate(warm, max_new_tokens=max_new, temperature=0.0)
        for _ in range(repeats):
            for i, prompt in enumerate(ids[2:]):
                stats = engine.generate(prompt, max_new_tokens=max_new, temperature=0.0).stats
                times[i].append(stats["time_total_s"])
                rounds += stats["rounds"]
                for key in PHASES:
                    phases[key] += stats[key]
    return {"per_prompt": [statistics.median(t) for t in times],
            "per_round_ms": {k.removeprefix("time_").removesuffix("_s"): round(v / rounds * 1e3, 3)
                             for k, v in phases.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--arm", action="append", default=[], metavar="NAME=KEY=V[,KEY=V...]",
                   help="an arm: its name and its --set overrides, comma-separated (the first arm is the reference)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(one_run(args.config, args.child, args.prompts, args.repeats, args.max_new_tokens)))
        return 0
    if not args.arm:
        p.error("give at least one --arm")
    arms = {name: sets.split(",") if sets else [] for name, _, sets in (a.partition("=") for a in args.arm)}
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            cmd = [sys.executable, __file__, "--config", args.config, "--prompts", str(args.prompts), "--repeats",
                   str(args.repeats), "--max-new-tokens", str(args.max_new_tokens), "--child", *arms[name]]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            runs[name].append(json.loads(out))
            print(f"round {r + 1}/{args.rounds}: {name} done", file=sys.stderr, flush=True)
    medians = {n: [statistics.median(t) for t in zip(*(run["per_prompt"] for run in v))] for n, v in runs.items()}
    ref = names[0]
    print(f"| arm | time / {ref}'s (median over prompts) | each round | per round, ms (last run) |")
    print("|---|---:|---|---|")
    for name in names:
        ratio = statistics.median(m / b for m, b in zip(medians[name], medians[ref]))
        each = ", ".join(f"{statistics.median(m / b for m, b in zip(run['per_prompt'], medians[ref])):.3f}"
                         for run in runs[name])
        phases = ", ".join(f"{k} {v}" for k, v in runs[name][-1]["per_round_ms"].items())
        print(f"| {name} | {ratio:.3f} | {each} | {phases} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
