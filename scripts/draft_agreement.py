"""The model draft against the target, offline: how often the draft's next token is the target's, and what that
can earn at this machine's costs.

The target alone (the config's export, its kernels) decodes greedily the first turns of --chat MT-Bench
questions (through its chat template) and --code HumanEval prompts. Along those outputs, teacher-forced, the draft's
argmax is compared with the target's token at every position, for LM heads of several sizes (`draft.head`, the
shipped rule of draft/head.py, and all rows by the standard library's counts); the draft's one-token step and the
target's pass over 1-5 tokens are timed (medians, interleaved). Last, what a round of gamma drafts would earn at
those costs, replayed along the same outputs: a chain (the engine's model rounds), and a chain with each depth's
second choice beside it (a two-way token tree, one target pass over both). A round's cost is the draft steps plus
the target's pass over its tokens; the speedup is over the target's one-token steps.

    python scripts/draft_agreement.py --config configs/qwen2.5-coder-1.5b.yaml --chat 16 --code 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEADS = (32768, 49152, 65536, None)  # None: the whole vocabulary


def target_outputs(target, prompts: list[list[int]], n_new: int) -> list[tuple[list[int], list[int]]]:
    out = []
    for ids in prompts:
        state = target.new_state()
        gen = [int(target.append(state, ids, last_only=True)[-1].argmax())]
        while len(gen) < n_new:
            gen.append(int(target.append(state, [gen[-1]], scratch=True)[-1].argmax()))
        out.append((ids, gen))
    return out


def pass_costs(decoders: dict, ks: dict, reps: int) -> dict:
    """Seconds of one pass over k tokens after a 200-token context (k = 1: a step), per decoder and k in ks[name]:
    medians of reps, the decoders taken in turn within each rep (the machine's drift falls on all alike)."""
    states = {}
    for name, decoder in decoders.items():
        states[name] = decoder.new_state()
        decoder.append(states[name], list(range(1000, 1200)), last_only=True)
    times: dict = {(name, k): [] for name in decoders for k in ks[name]}
    for _ in range(reps):
        for name, decoder in decoders.items():
            for k in ks[name]:
                started = time.perf_counter()
                for i in range(4 if k == 1 else 1):  # steps in a row, as a draft takes them
                    logits = decoder.append(states[name], list(range(500 + i, 500 + i + k)), scratch=k == 1)
                    int(logits[-1].argmax())
                times[name, k].append((time.perf_counter() - started) / (4 if k == 1 else 1))
                decoder.rewind(states[name], 200)
    return {key: statistics.median(v) for key, v in times.items()}


def ranked(draft, runs, keep: np.ndarray | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per run: the draft's top-2 tokens at each generated position (restricted to `keep`), and the target's."""
    out = []
    for ids, gen in runs:
        logits = draft.append(draft.new_state(), ids + gen[:-1])[len(ids) - 1:]
        if keep is not None:
            logits = np.where(keep[None], logits, -np.inf)
        out.append((np.argsort(-logits, axis=1)[:, :2], np.asarray(gen)))
    return out


def replay(tops, gamma: int, siblings: bool, step_s: float, verify, draft_s: float) -> float:
    """Speedup over the target alone of rounds of `gamma` drafts along the outputs (see the module docstring)."""
    tokens, cost = 0, 0.0
    for top, gen in tops:
        t = 0
        while t < len(gen):
            i = 0
            while i < gamma and t + i < len(gen) and top[t + i, 0] == gen[t + i]:
                i += 1
            n = i + 1 + (1 if siblings and i < gamma and t + i < len(gen) and top[t + i, 1] == gen[t + i] else 0)
            n = min(n, len(gen) - t)
            tokens, t = tokens + n, t + n
            cost += verify(gamma * (2 if siblings else 1) + 1) + gamma * draft_s
    return tokens * step_s / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "qwen2.5-coder-1.5b.yaml"))
    ap.add_argument("--chat", type=int, default=16, help="MT-Bench questions (first turns)")
    ap.add_argument("--code", type=int, default=16, help="HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()

    from hetero_spec import Engine
    from hetero_spec.bench.prompts import humaneval_prompt_ids, load_tokenizer, mtbench_questions
    from hetero_spec.draft import head
    from hetero_spec.onnx_decoder import OnnxDecoder

    # the engine resolves the config's models (GGUF -> export) and is closed before anything is timed
    with Engine.from_config(args.config, overrides={"draft.head": None, "draft.candidates": ["onnx"]}) as eng:
        target_dir, draft_dir, cfg = Path(eng.target.model_dir), Path(eng.config.draft.model), eng.config
    kernels, threads = cfg.runtime.kernels, cfg.target.threads
    # spin="run": pool threads stop spinning when a run returns, as in the engine, so that one session's idle
    # threads never slow the next session's run (the decoders are timed in turn)
    target = OnnxDecoder(target_dir, threads=threads, role="target", kernels=kernels, spin="run")
    tok = load_tokenizer(cfg.target.model)
    chat = [list(tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)) for q in mtbench_questions(args.chat)]
    workloads = {"chat": target_outputs(target, [[int(t) for t in p] for p in chat], args.max_new_tokens),
                 "code": target_outputs(target, humaneval_prompt_ids(cfg, args.code), args.max_new_tokens)}
    vocab = target.vocab_width
    drafts = {h: OnnxDecoder(head.cached_pruned(draft_dir, h) if h else draft_dir, threads=cfg.draft.threads,
                             role="draft", kernels=kernels, vocab_width=vocab, spin="run") for h in HEADS}
    timed = pass_costs({"target": target, **drafts}, {"target": (1, 2, 3, 4, 5, 7), **{h: (1,) for h in drafts}},
                       args.reps)
    verify = {k: timed["target", k] for k in (1, 2, 3, 4, 5, 7)}
    steps = {h: timed[h, 1] for h in drafts}
    full = drafts[None]
    slope = (verify[7] - verify[1]) / 6
    cost = lambda k: verify.get(k, verify[1] + slope * (k - 1))  # noqa: E731 - a pass over k tokens
    print(f"target: one-token step {verify[1] * 1e3:.2f} ms; a pass over k tokens: "
          + ", ".join(f"{k}: {v / verify[1]:.2f}" for k, v in verify.items()) + " steps")

    rules = {}
    for h in HEADS[:-1]:
        rules[f"{h}, shipped rule"] = (h, head.head_tokens(draft_dir, h, vocab))
        rules[f"{h}, all by the standard library"] = (h, head.head_tokens(draft_dir, h, vocab, code_share=1.0))
    rules["whole vocabulary"] = (None, None)
    print("\n| draft head | step ms | " + " | ".join(f"{w}: agreement" for w in workloads) + " |")
    print("|---|---:|" + "---:|" * len(workloads))
    tops: dict[tuple[str, str], list] = {}
    for name, (h, ids) in rules.items():
        keep = None
        if ids is not None:
            keep = np.zeros(vocab, dtype=bool)
            keep[ids] = True
        cells = []
        for w, runs in workloads.items():
            tops[name, w] = ranked(full, runs, keep)
            hits = sum(int((top[:, 0] == gen).sum()) for top, gen in tops[name, w])
            cells.append(f"{hits / sum(len(g) for _, g in tops[name, w]):.3f}")
        print(f"| {name} | {steps[h] * 1e3:.2f} | " + " | ".join(cells) + " |")

    print("\nreplayed speedup over the target alone's steps (gamma drafts a round):")
    print("| draft head | workload | " + " | ".join(f"chain {g}" for g in (1, 2, 3, 4))
          + " | " + " | ".join(f"chain {g} + 2nd choices" for g in (1, 2, 3)) + " |")
    print("|---|---|" + "---:|" * 7)
    for name, (h, _) in rules.items():
        if "standard library" in name:
            continue
        for w in workloads:
            chains = [replay(tops[name, w], g, False, verify[1], cost, steps[h]) for g in (1, 2, 3, 4)]
            trees = [replay(tops[name, w], g, True, verify[1], cost, steps[h]) for g in (1, 2, 3)]
            print(f"| {name} | {w} | " + " | ".join(f"{x:.2f}x" for x in chains + trees) + " |")


if __name__ == "__main__":
    main()
