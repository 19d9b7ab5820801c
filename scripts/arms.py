"""Arms of one config on MT-Bench's first turns or HumanEval's prompts, every arm's Engine in this one process,
interleaved per prompt (the order rotating), --repeats passes; fixed-length outputs. Prints each run, then per
arm the median over (prompt, pass) of the first arm's time / its time, and the ratio of the summed times; likewise
against --base.

    python scripts/arms.py --config configs/qwen2.5-coder-1.5b.yaml --prompts mt-bench:16 --repeats 2 \\
        --arm 'alone=draft.kind=none,draft.candidates=[]' --arm chain=draft.second_choices=0 --arm tree2= \\
        --base chain
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from hetero_spec.bench.prompts import humaneval_prompt_ids, load_tokenizer, mtbench_questions, parse_prompts_arg
    from hetero_spec.config import load_config, parse_override
    from hetero_spec.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--arm", action="append", required=True, help="NAME=key=value,key=value (empty: the config)")
    ap.add_argument("--base", help="an arm to compare the others with, besides the first")
    ap.add_argument("--prompts", type=parse_prompts_arg, default=("mt-bench", 16),
                    help="mt-bench:N (first turns of N questions, spread over the categories) or humaneval:N")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()

    config = load_config(args.config)
    if not isinstance(args.prompts, tuple):
        ap.error("--prompts: mt-bench:N or humaneval:N")
    suite, count = args.prompts
    if suite == "humaneval":
        prompts = [("humaneval", ids) for ids in humaneval_prompt_ids(config, count or 8)]
    else:
        tok = load_tokenizer(config.target.model)
        prompts = [(q["category"], list(tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}],
                                                                add_generation_prompt=True, tokenize=True,
                                                                return_dict=False)))
                   for q in mtbench_questions(count or 16)]
    arms = {}
    for spec in args.arm:
        name, _, sets = spec.partition("=")
        overrides = dict(parse_override(s) for s in _split(sets)) if sets else {}
        arms[name] = Engine.from_config(args.config, overrides={**overrides, "generation.ignore_eos": True})
    names = list(arms)
    for engine in arms.values():  # warm-up, untimed
        engine.generate(prompts[0][1], max_new_tokens=16)
    times: dict[str, list[float]] = {n: [] for n in names}
    turn = 0
    for rep in range(args.repeats):
        for i, (category, ids) in enumerate(prompts):
            order = names[turn % len(names):] + names[:turn % len(names)]
            turn += 1
            for name in order:
                started = time.perf_counter()
                out = arms[name].generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                          seed=i)
                times[name].append(time.perf_counter() - started)
                s = out.stats
                print(f"{rep} {i:2d} {category:<10} {name:<8} {times[name][-1]:6.3f} s  acceptance "
                      f"{s['acceptance_rate']}  tokens/round {s['tokens_per_round']}  tree taken/tokens "
                      f"{s['tree_taken']}/{s['tree_tokens']}", flush=True)
    for base in dict.fromkeys([names[0], args.base or names[0]]):
        for name in names:
            if name != base:
                ratios = [b / a for a, b in zip(times[name], times[base])]
                print(f"{name} vs {base}: median {statistics.median(ratios):.3f}x, summed "
                      f"{sum(times[base]) / sum(times[name]):.3f}x, faster on {sum(r > 1 for r in ratios)}/"
                      f"{len(ratios)}")
    for engine in arms.values():
        engine.close()


def _split(sets: str) -> list[str]:
    """key=value pairs split on the commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in sets:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [s for s in [*out, cur] if s]


if __name__ == "__main__":
    main()
