"""How often each lookup's next token is the target's, offline, along the target's own greedy output.

The target alone decodes N HumanEval prompts (config's target, ignore_eos, --max-new-tokens); then at every
generated position the prompt lookup (draft/ngram.py, max_n 3) and the corpus lookup (draft/corpus.py) are asked
for one token, and the answers are compared with the target's. Prints the hit rates by the prompt lookup's
matched length, and where it matched at most one token, the corpus lookup's by its matched context length.

    python scripts/corpus_lookup_eval.py --config configs/qwen2.5-coder-1.5b.yaml --prompts 8
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "qwen2.5-coder-1.5b.yaml"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()

    from hetero_spec import Engine
    from hetero_spec.bench.prompts import humaneval_prompt_ids
    from hetero_spec.draft.corpus import CorpusProposer, cached_table
    from hetero_spec.draft.ngram import NgramProposer

    alone = {"draft.kind": "none", "draft.model": None, "draft.precision": None, "draft.candidates": [],
             "draft.head": None}
    with Engine.from_config(args.config, overrides=alone) as eng:
        table = cached_table(Path(eng.target.model_dir) / "tokenizer.json")
        runs = []
        for i, p in enumerate(humaneval_prompt_ids(eng.config, args.prompts)):
            runs.append((p, eng.generate(p, max_new_tokens=args.max_new_tokens, ignore_eos=True).token_ids))
            print(f"prompt {i + 1}/{args.prompts}: {len(p)} + {len(runs[-1][1])} tokens", file=sys.stderr)
    by_prompt_match, corpus_where_short = defaultdict(lambda: [0, 0]), defaultdict(lambda: [0, 0])
    for prompt, out in runs:
        full = prompt + out
        for i in range(len(prompt), len(full)):
            ng, co = NgramProposer(max_n=3), CorpusProposer(table)
            ng.begin(full[:i], None)
            co.begin(full[:i], None)
            d, c = ng.propose(1), co.propose(1)
            row = by_prompt_match[d.match if d.ids else 0]
            row[0], row[1] = row[0] + 1, row[1] + (bool(d.ids) and d.ids[0] == full[i])
            if (d.match if d.ids else 0) <= 1:
                row = corpus_where_short[c.match if c.ids else 0]
                row[0], row[1] = row[0] + 1, row[1] + (bool(c.ids) and c.ids[0] == full[i])
    total = sum(n for n, _ in by_prompt_match.values())
    print(f"{len(runs)} prompts, {total} generated positions")
    print("| prompt lookup's match | positions | its next token right |\n|---:|---:|---:|")
    for m in sorted(by_prompt_match):
        n, hit = by_prompt_match[m]
        print(f"| {m or 'none'} | {n} | {hit / n:.0%} |")
    print("\nWhere the prompt lookup matched at most one token:\n")
    print("| corpus context matched | positions | its next token right |\n|---:|---:|---:|")
    for m in sorted(corpus_where_short, reverse=True):
        n, hit = corpus_where_short[m]
        print(f"| {m or 'none'} | {n} | {hit / n:.0%} |")


if __name__ == "__main__":
    main()
