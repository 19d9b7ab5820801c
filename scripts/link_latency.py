"""What the link's latency costs per round: the demo pair in two processes with every message delayed by 0, 0.2,
1 and 5 ms (tests/fixtures/slowlink, a fault-injection fixture put on PYTHONPATH for the target and the worker;
not a config field), against the target alone, greedy, with the controller choosing gamma. Each delay runs in a
fresh process; the delays rotate over `--repeats` (interleaved). Reports, per delay, the median tokens per second
as a ratio to the target alone (paired per repeat), the rounds that drafted, the mean drafted block, the link's
transfer time as the controller measured it, and the largest transfer time at which the cost model still predicts
a gain at that run's costs and acceptance (the break-even).

    .venv/bin/python scripts/link_latency.py --config configs/cpu-demo.yaml --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DELAYS_MS = (0.0, 0.2, 1.0, 5.0)

DRIVER = r'''
import json, sys
from pathlib import Path
from hetero_spec import Engine
from hetero_spec.bench.prompts import heldout_prompt_ids
from hetero_spec.config import load_config

path, mode, n, max_new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
over = {"runtime.mode": mode, "runtime.cpus": None, "target.threads": 1, "draft.threads": 1}
if mode == "alone":
    over = {"runtime.mode": "in_process", "runtime.cpus": None, "draft.kind": "none", "draft.candidates": []}
cfg = load_config(path, overrides=over)
prompts = heldout_prompt_ids(cfg, Path(path), n, 128)
with Engine.from_config(cfg) as eng:
    eng.generate(prompts[0], max_new_tokens=8, temperature=0.0)  # warm-up
    tok = secs = rounds = drafting = drafted = 0
    for p in prompts:
        out = eng.generate(p, max_new_tokens=max_new, temperature=0.0)
        s = out.stats
        tok += s["new_tokens"]; secs += s["time_total_s"]; rounds += s["rounds"]; drafted += s["drafted"]
        drafting += s["rounds"] - (s["accept_hist"][0] if s["accept_hist"] else 0) if s["drafted"] else 0
    res = {"tokens_per_s": tok / secs, "rounds": rounds, "drafted": drafted}
    if mode == "two_process":
        t = eng.controller.tuning
        m = t.model()
        a = t.global_acceptance()
        res.update(transfer_ms=1e3 * t.transfer_s, acceptance=a,
                   break_even_ms=1e3 * m.break_even_transfer_s(a) if m is not None else None,
                   verify0_ms=1e3 * m.verify(0) if m is not None else None)
print("RESULT " + json.dumps(res))
'''


def run(config: str, mode: str, delay_ms: float, n: int, max_new: int) -> dict:
    env = dict(os.environ, HETERO_SPEC_TEST_LINK_DELAY_MS=str(delay_ms),
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "fixtures" / "slowlink"), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", DRIVER, config, mode, str(n), str(max_new)], env=env,
                         capture_output=True, text=True, timeout=1800)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not line:
        raise SystemExit(f"{mode} at {delay_ms} ms failed:\n{out.stderr[-2000:]}")
    return json.loads(line[-1][7:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/cpu-demo.yaml")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="OUT")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"alone": [], **{str(d): [] for d in DELAYS_MS}}
    for rep in range(args.repeats):
        order = ["alone", *map(str, DELAYS_MS)]
        order = order[rep % len(order):] + order[:rep % len(order)]
        for key in order:
            mode = "alone" if key == "alone" else "two_process"
            r = run(args.config, mode, 0.0 if key == "alone" else float(key), args.prompts, args.max_new_tokens)
            runs[key].append(r)
            print(f"link_latency: repeat {rep + 1}/{args.repeats} {key}: {r['tokens_per_s']:.1f} tok/s", flush=True)
    rows = []
    for d in DELAYS_MS:
        rs = runs[str(d)]
        ratio = statistics.median(r["tokens_per_s"] / a["tokens_per_s"] for r, a in zip(rs, runs["alone"]))
        rows.append({"delay_ms": d, "vs_target_alone": round(ratio, 3),
                     "drafted_per_round": round(statistics.median(r["drafted"] / r["rounds"] for r in rs), 2),
                     "transfer_ms": round(statistics.median(r["transfer_ms"] for r in rs), 3),
                     "break_even_ms": round(statistics.median(r["break_even_ms"] for r in rs), 3),
                     "acceptance": round(statistics.median(r["acceptance"] for r in rs), 3)})
    (out / "link_latency.json").write_text(json.dumps({"rows": rows, "runs": runs}, indent=2))
    print("| one-way delay per message (ms) | vs target alone | drafted per round | transfer measured (ms) | "
          "break-even transfer (ms) | acceptance |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['delay_ms']} | {r['vs_target_alone']} | {r['drafted_per_round']} | {r['transfer_ms']} | "
              f"{r['break_even_ms']} | {r['acceptance']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
