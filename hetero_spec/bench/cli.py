"""`hetero-spec bench` arguments -> settings -> run."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..config import parse_override
from .context import DEFAULT_PROMPT_TOKENS, BenchError, BenchSettings
from .report import render_markdown
from .run import run_bench

DEFAULT_GAMMAS = "4,6,8,10,12"  # the system comparison's calibration candidates


def prompts_count(value: int | str | None) -> tuple[int | None, bool]:
    """--prompts -> (count or None, HumanEval?): `12` -> (12, False), `humaneval` -> (None, True) (all 164),
    `humaneval:20` -> (20, True)."""
    if isinstance(value, str):
        _, _, n = value.partition(":")
        return (int(n) if n else None), True
    return value, False


def settings_from_args(args) -> BenchSettings:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else None
    n_prompts, humaneval = prompts_count(args.prompts)
    if humaneval and args.prompts_file:
        raise BenchError("--prompts humaneval and --prompts-file: choose one source of prompts")
    for name, val in (("--prompts", n_prompts), ("--max-new-tokens", args.max_new_tokens),
                      ("--repeats", args.repeats),
                      ("--prompt-tokens", args.prompt_tokens)):
        if val is not None and val < 1:
            raise BenchError(f"{name} must be >= 1, got {val}")
    if args.temperature < 0:
        raise BenchError(f"--temperature must be >= 0, got {args.temperature}")
    gammas = None
    text = args.gammas if args.gammas is not None else DEFAULT_GAMMAS
    if not args.quick and text.strip() != "config":
        try:
            gammas = tuple(int(g) for g in text.split(",") if g.strip())
        except ValueError:
            raise BenchError(f"--gammas must be comma-separated integers or 'config', got {text!r}") from None
        if not gammas or any(not 1 <= g <= 64 for g in gammas):
            raise BenchError(f"--gammas: each draft length must be in 1..64, got {text!r}")
    if getattr(args, "layouts", None):
        raise BenchError("--layouts applies only with --scenario (the system comparison has its own layouts)")
    llama = {key: Path(v) if (v := getattr(args, key, None)) else None
             for key in ("llama_cpp", "llama_cpp_target", "llama_cpp_draft")}
    return BenchSettings(config=Path(args.config), out=Path(args.out), prompts=n_prompts, humaneval=humaneval,
                         max_new_tokens=args.max_new_tokens, systems=systems, quick=args.quick,
                         overrides=dict(parse_override(p) for p in args.overrides),
                         draft_hf=Path(args.draft_hf) if args.draft_hf else None,
                         prompt_tokens=args.prompt_tokens or DEFAULT_PROMPT_TOKENS,
                         ort_target=Path(args.ort_target) if args.ort_target else None,
                         temperature=args.temperature, sampling=args.sampling, gammas=gammas,
                         repeats=args.repeats or 1,
                         prompts_file=Path(args.prompts_file) if args.prompts_file else None, **llama)


def run_bench_cli(args) -> int:
    if getattr(args, "scenarios", None):
        from .tuning_bench import run_tuning_cli

        return run_tuning_cli(args)
    settings = settings_from_args(args)
    t = time.perf_counter()
    report = run_bench(settings)
    print(render_markdown(report), end="")
    print(f"[bench: {time.perf_counter() - t:.0f} s; wrote {settings.out / 'bench.json'}, bench.md, bench.png]",
          file=sys.stderr)
    return 0
