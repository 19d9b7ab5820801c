"""Offline replay of draft selection on the repetitive bench's prompts (docs/benchmarks.md: the tuning
scenarios). No engine runs: the target's greedy output is computed once with transformers; then, at every
position, the n-gram lookup's proposal (and the length of the suffix it matched) and the draft's run of
agreement with the target (teacher-forced along the target's output: exact for greedy drafting) are known,
and each policy is replayed against a cost model of one round:

    n-gram:  V(g)                                  model: g * d + V(g) (+ its catch-up or prefill)
    V(g) = verify_fixed + verify_per_token * (g + 1)

Prints the best fixed gamma of each policy and its speed over the target alone, for the draft reading the
whole prompt and for prompt windows of 16, 32 and 64 tokens. Give the step costs measured on the machine at
hand (ms; defaults: this 2-core machine on 2026-11-30, fp32 target on 2 threads, int8 draft on 1).

    python scripts/selection_replay.py [--verify-fixed 4.05 --verify-per-token 0.3 --draft-token 1.0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WINDOWS = (None, 64, 32, 16)


def replay_rows(n_prompts: int, max_new: int) -> list[list[tuple]]:
    """Per prompt, per generated position: (matched suffix length, n-gram accepted, n-gram proposal length,
    the draft's run of agreement for each window in WINDOWS)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hetero_spec.bench.prompts import heldout_prompt_ids
    from hetero_spec.config import load_config
    from hetero_spec.draft.ngram import NgramProposer
    from tuning_scenarios import repetitive_set  # scripts/, beside this file

    cfgp = ROOT / "configs" / "cpu-demo.yaml"
    config = load_config(cfgp)
    rep = repetitive_set(config, heldout_prompt_ids(config, cfgp, 2 * (n_prompts + 2) + 8, 128), n_prompts)
    target = AutoModelForCausalLM.from_pretrained(ROOT / "models" / "target").eval()
    draft = AutoModelForCausalLM.from_pretrained(ROOT / "models" / "draft").eval()
    out = []
    for pi, prompt in enumerate(rep):
        with torch.no_grad():
            full = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)[0].tolist()
            argmax = {}
            for w in WINDOWS:
                s = 0 if w is None else max(0, len(prompt) - w)
                argmax[w] = (s, draft(torch.tensor([full[s:]])).logits[0].argmax(-1).tolist())
        rows = []
        for i in range(len(prompt), len(full)):
            ng = NgramProposer(max_n=3, min_n=1)
            ng.begin(full[:i], None)
            match = next((n for n in range(min(3, i - 1), 0, -1)
                          if (hit := ng._index[n].get(tuple(full[i - n:i]))) is not None and hit[1] >= 0), 0)
            prop = ng.propose(16).ids
            a = 0
            while a < len(prop) and i + a < len(full) and prop[a] == full[i + a]:
                a += 1
            runs = []
            for w in WINDOWS:
                s, am = argmax[w]
                r = 0
                while i + r < len(full) and am[i + r - 1 - s] == full[i + r]:
                    r += 1
                runs.append(r)
            rows.append((match, a, len(prop), *runs))
        out.append(rows)
        print(f"prompt {pi + 1}/{len(rep)}: {len(prompt)} + {len(full) - len(prompt)} tokens", file=sys.stderr)
    return out


def simulate(data, policy, window, vf, vp, d, prefill_ms_per_token, skip=4):
    """Tokens per ms of `policy(match, a, L, r) -> (kind, gamma)` over every prompt."""
    wi = 3 + WINDOWS.index(window)
    tot = toks = 0.0
    for rows in data:
        i, fresh, last, backlog = 0, True, None, 0
        prompt_len = 170  # the bench's prompts are 144-194 tokens
        while i < len(rows):
            match, a, L, r = rows[i][0], rows[i][1], rows[i][2], rows[i][wi]
            kind, g = policy(match, a, L, r)
            if kind == "ngram" and L:
                g = min(g, L)
                acc, cost = min(a, g), vf + vp * (g + 1)
            elif kind == "model" and g:
                acc, cost = min(r, g), g * d + vf + vp * (g + 1)
                if fresh:  # the draft's prefill: the prompt (or its window) and what was committed since
                    cost += prefill_ms_per_token * (window or prompt_len + i)
                    fresh = False
                elif last != "model":  # catch-up of the lookup's tokens (the last `skip` of them)
                    cost += prefill_ms_per_token * min(backlog, skip)
            else:
                acc, cost = 0, vf + vp
            backlog = 0 if kind == "model" else backlog + acc + 1
            last = kind
            tot += cost
            i += acc + 1
            toks += acc + 1
    return toks / tot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--verify-fixed", type=float, default=4.05, help="ms of a verify pass (intercept)")
    p.add_argument("--verify-per-token", type=float, default=0.3, help="ms per verified token")
    p.add_argument("--draft-token", type=float, default=1.0, help="ms per drafted token")
    p.add_argument("--prefill-token", type=float, default=0.27, help="ms per token of the draft's prefill")
    a = p.parse_args()
    data = replay_rows(a.prompts, a.max_new_tokens)
    costs = (a.verify_fixed, a.verify_per_token, a.draft_token, a.prefill_token)
    alone = simulate(data, lambda *_: ("none", 0), None, *costs)
    for match in range(4):
        sel = [r for rows in data for r in rows if r[0] == match]
        print(f"matched suffix {match}: {len(sel)} positions, n-gram accepts {np.mean([r[1] for r in sel]):.2f}, "
              f"the draft agrees for {np.mean([min(r[3], 16) for r in sel]):.2f} tokens (whole prompt)")
    print("| draft reads | n-gram alone | model alone | selection | selection / n-gram |\n|---|---:|---:|---:|---:|")
    for w in WINDOWS:
        best = {}
        for g in range(1, 13):
            for g2 in range(1, 9):
                for name, pol in (("ngram", lambda m, x, L, r, g=g: ("ngram", g)),
                                  ("model", lambda m, x, L, r, g2=g2: ("model", g2)),
                                  ("select", lambda m, x, L, r, g=g, g2=g2: ("ngram", g) if L else ("model", g2))):
                    best[name] = max(best.get(name, 0.0), simulate(data, pol, w, *costs) / alone)
        print(f"| {'the whole prompt' if w is None else f'its last {w} tokens'} | {best['ngram']:.3f}x | "
              f"{best['model']:.3f}x | {best['select']:.3f}x | {best['select'] / best['ngram']:.3f}x |")


if __name__ == "__main__":
    main()
