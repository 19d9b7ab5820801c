"""Re-run a tuning scenario (formerly `hetero-spec bench --scenario`) through the bench harness: every arm an
Engine, all warmed up untimed on two held-out prompts, run interleaved per prompt with the order rotating (a
prompt's time: the median of its repeats), and each arm paired per prompt with the target alone (throughput
ratio: median, range, prompts won, identical outputs). No verdicts: read the ratios. Writes OUT/SCENARIO.json
and OUT/SCENARIO.md.

    python scripts/tuning_scenarios.py gamma-sweep --config configs/cpu-demo.yaml [--layout two_process]
    python scripts/tuning_scenarios.py repetitive --config configs/cpu-demo.yaml
    python scripts/tuning_scenarios.py useless-draft --config configs/cpu-demo.yaml [--draft-hf models/draft]

- gamma-sweep: every fixed gamma of --gammas (one engine, gamma per request) against gamma auto (its own engine).
- repetitive: prompts whose text repeats its own first lines; the model draft alone, the n-gram lookup alone (in
  process: it has no worker) and per-round selection between them (draft.candidates: [onnx, ngram]).
- useless-draft: an untrained draft of the Hugging Face draft's shape (random weights, built and exported once
  into the cache) with gamma auto, in --layout and with the layout chosen by measurement (runtime.mode auto).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetero_spec.bench.harness import (CPU_FP32, REFERENCE, RunOutput, fmt, interleave, pair,  # noqa: E402
                                       per_prompt, proc_state, table, write_report)

ALONE = {"draft.kind": "none", "draft.candidates": [], "runtime.mode": "in_process"}
WARMUP = 2


def repetitive_text(text: str, min_lines: int = 4) -> str | None:
    """The complete lines of text (its cut first and last ones dropped), then its first half again, ending where
    the next line of the repeat would follow; None with fewer than min_lines non-blank lines."""
    lines = text.split("\n")[1:-1]
    if sum(bool(line.strip()) for line in lines) < min_lines:
        return None
    return "\n".join(lines + lines[:max(1, round(len(lines) / 2))]) + "\n"


def repetitive_set(config, sources: list[list[int]], count: int) -> list[list[int]]:
    """Up to `count` repetitive prompts as the target's token ids, built from the source prompts' text."""
    from hetero_spec.bench.prompts import load_tokenizer

    tok = load_tokenizer(config.target.model)
    texts = [t for p in sources if (t := repetitive_text(tok.decode(p)))]
    return [tok.encode(t, add_special_tokens=False) for t in texts[:count]]


def useless_draft(source: Path) -> Path:
    """source's architecture and tokenizer with random weights (seed 0), exported int4 (block 128, like the
    shipped draft) once into the cache; returns the ONNX directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hetero_spec.draft.export import export_draft
    from hetero_spec.target.export_cache import cache_root

    key = hashlib.sha256(b"".join((source / n).read_bytes() for n in ("config.json", "tokenizer.json"))).hexdigest()
    entry = cache_root() / f"useless-draft-{key[:16]}"
    if not (entry / "onnx" / "model.onnx").is_file():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source)).save_pretrained(entry / "hf")
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (source / name).is_file():
                shutil.copy(source / name, entry / "hf" / name)
        export_draft(entry / "hf", entry / "onnx", "int4", block_size=128)
    return entry / "onnx"


def arms_of(args, config) -> tuple[dict, dict]:
    """(engine name -> overrides, arm name -> (engine, gamma per request)) of the scenario."""
    layout, spec = {"runtime.mode": args.layout}, {"draft.kind": "onnx", "draft.candidates": []}
    engines, arms = {REFERENCE: ALONE}, {REFERENCE: (REFERENCE, None)}
    if args.scenario == "gamma-sweep":
        engines |= {"fixed": {**spec, **layout}, "auto": {**spec, **layout, "speculation.gamma": "auto"}}
        arms |= {f"gamma={g}": ("fixed", g) for g in args.gammas} | {"auto": ("auto", None)}
    elif args.scenario == "repetitive":
        engines |= {"onnx": {**spec, **layout}, "ngram": {**spec, "draft.kind": "ngram", "runtime.mode": "in_process"},
                    "select": {**spec, **layout, "draft.candidates": ["onnx", "ngram"]}}
    else:
        useless = {**spec, "draft.model": str(useless_draft(args.draft_hf or Path(config.draft.model))),
                   "draft.precision": None, "speculation.gamma": "auto"}
        engines |= {f"auto {args.layout}": {**useless, **layout},
                    "auto placement": {**useless, "runtime.mode": "auto", "runtime.cpus": "auto"}}
    return engines, arms | {n: (n, None) for n in engines if n not in arms and n != "fixed"}


def main(argv: list[str] | None = None) -> int:
    from hetero_spec.bench.prompts import heldout_prompt_ids
    from hetero_spec.config import load_config, parse_override
    from hetero_spec.engine import Engine

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=["gamma-sweep", "repetitive", "useless-draft"])
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--out", type=Path, default=Path("bench-out/tuning"))
    p.add_argument("--layout", default="in_process", choices=["in_process", "two_process"])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gammas", type=lambda v: [int(g) for g in v.split(",")], default=list(range(1, 17)))
    p.add_argument("--draft-hf", type=Path, default=None, help="useless-draft: the checkpoint whose shape it copies")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    args = p.parse_args(argv)
    base = {**dict(parse_override(o) for o in args.overrides), **CPU_FP32}
    config = load_config(args.config, overrides=base)
    n = args.prompts + WARMUP
    prompts = heldout_prompt_ids(config, args.config, 2 * n + 8 if args.scenario == "repetitive" else n, 128)
    prompts = repetitive_set(config, prompts, n) if args.scenario == "repetitive" else prompts[:n]
    timed, warm = prompts[:args.prompts], prompts[args.prompts:]
    engines, arms = arms_of(args, config)
    baseline, live = proc_state(), {}
    try:
        for name, over in engines.items():
            print(f"starting {name}, warm-up on {len(warm)} prompts", file=sys.stderr, flush=True)
            proc_state(baseline)
            live[name] = [Engine.from_config(args.config, overrides={**base, **over}), None]
            for w in warm:
                live[name][0].generate(w, max_new_tokens=args.max_new_tokens, temperature=0.0)
            live[name][1] = proc_state()

        def run(arm: str, prompt: list[int]) -> RunOutput:
            engine, state = live[arms[arm][0]]
            proc_state(state)
            out = engine.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=0.0, gamma=arms[arm][1])
            return RunOutput(out.token_ids, out.stats)

        runs, failed = interleave(list(arms), timed, args.repeats, run, must=(REFERENCE,),
                                  say=lambda t: print(t, file=sys.stderr, flush=True))
    finally:
        for engine, _ in live.values():
            engine.close()
        proc_state(baseline)
    pp = {a: per_prompt(r) for a, r in runs.items()}
    rows = []
    for arm in arms:
        if arm in failed:
            rows.append([arm, f"failed: {failed[arm]}", "-", "-", "-", "-"])
            continue
        v, st = pair(pp[arm], pp[REFERENCE]), [x["stats"] or {} for x in pp[arm]]
        drafted = sum(s.get("drafted") or 0 for s in st)
        rows.append([arm, f"{v['median']:.3f}x", f"{v['min']:.2f}-{v['max']:.2f}", f"{v['won']}/{v['prompts']}",
                     f"{v['identical']}/{v['prompts']}", fmt(sum(s.get("accepted") or 0 for s in st) / drafted
                                                            if drafted else None)])
    md = "\n".join([f"# {args.scenario} ({args.layout}): {len(timed)} prompts x {args.max_new_tokens} tokens x "
                    f"{args.repeats} repeats", "", *table(["arm", "vs target_only (median)", "range", "faster on",
                                                           "identical", "acceptance"], rows)]) + "\n"
    write_report(args.out, args.scenario, {"scenario": args.scenario, "layout": args.layout, "engines": engines,
                                           "failed": failed, "per_prompt": pp}, md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
