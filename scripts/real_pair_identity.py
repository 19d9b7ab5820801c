"""Greedy identity of the real pair at fp32, on a CPU: the target alone against speculation in process and in two
processes (at a fixed gamma, so speculation cannot switch itself off and match trivially; a row fails when
nothing was drafted). The target is the converted Hugging Face checkpoint on the torch backend in fp32 (no export needed);
the draft is exported at fp32. Loads one engine at a time: peak memory is about the fp32 target (6.7 GB) plus the
draft (2 GB).

Usage: python scripts/real_pair_identity.py [--config configs/qwen2.5-coder-1.5b.yaml] [--tokens 64]
Prints one line per prompt and layout, then PASSED or FAILED (exit 1).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import json\n\n\ndef load_config(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "qwen2.5-coder-1.5b.yaml"))
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from hetero_spec import Engine

    # the model draft every round (no per-round choice among lookups: draft.candidates empty)
    fp32 = {"target.backend": "torch", "target.precision": "fp32", "target.device": "cpu", "target.threads": 2,
            "draft.precision": "fp32", "draft.candidates": [], "speculation.gamma": 4}
    t0 = time.monotonic()
    with Engine.from_config(args.config, overrides={**fp32, "draft.kind": "none", "draft.model": None,
                                                    "draft.precision": None}) as eng:
        ids = [eng.prompt_ids(p) for p in PROMPTS]
        refs = [eng.generate(p, max_new_tokens=args.tokens).token_ids for p in ids]
    print(f"[{time.monotonic() - t0:5.0f} s] target alone (torch fp32): {[len(r) for r in refs]} tokens", flush=True)
    ok = True
    for mode in ("in_process", "two_process"):
        with Engine.from_config(args.config, overrides={**fp32, "runtime.mode": mode,
                                                        "draft.threads": 1 if mode == "two_process" else 2,
                                                        "target.threads": 1 if mode == "two_process" else 2}) as eng:
            for i, (p, ref) in enumerate(zip(ids, refs)):
                out = eng.generate(p, max_new_tokens=args.tokens)
                same = out.token_ids == ref and out.stats["drafted"] > 0
                ok &= same
                print(f"[{time.monotonic() - t0:5.0f} s] {mode}, prompt {i}: {'identical' if same else 'DIFFERENT'}"
                      f" ({len(out.token_ids)} tokens, drafted {out.stats['drafted']}, acceptance "
                      f"{out.stats['acceptance_rate']})", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"{'PASSED' if ok else 'FAILED'}: greedy fp32 identity, {len(PROMPTS)} prompts x {args.tokens} tokens, in "
          f"process and in two processes; peak memory of this process {peak:.1f} GB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
