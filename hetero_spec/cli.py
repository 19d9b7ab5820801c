"""`hetero-spec` command line. A face of the engine: it parses arguments and calls the API, nothing more."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from .errors import ConfigError, HeteroSpecError

EPILOG = """examples:
  hetero-spec generate --config configs/cpu-demo.yaml --prompt "def parse(" --max-new-tokens 64
  hetero-spec generate --config configs/cpu-demo.yaml --prompt "import os" --set speculation.gamma=6 --json
  echo "def parse(" | hetero-spec generate --config configs/cpu-demo.yaml --set draft.kind=ngram
  hetero-spec export --model models/draft --out /tmp/draft-int4 --precision int4 --block-size 128
  hetero-spec profile --config configs/cpu-demo.yaml --out profiles/cpu.yaml --quick
  hetero-spec generate --config configs/cpu-demo.yaml --set speculation.gamma=auto --prompt "def f("
  hetero-spec bench --config configs/cpu-demo.yaml --out bench-out --repeats 2
  hetero-spec serve --config configs/cpu-demo.yaml --port 8000
"""


def _overrides(pairs: list[str]) -> dict[str, Any]:
    from .config import parse_override

    return dict(parse_override(p) for p in pairs)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion with speculative decoding",
                       description="Generate a completion. Greedy output (temperature 0) is token-identical "
                                   "to the target model alone; sampled output keeps its distribution.",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    p.add_argument("--config", required=True, help="YAML config file (see configs/)")
    p.add_argument("--prompt", default=None,
                   help="prompt text; read from standard input when omitted and stdin is not a terminal")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="most tokens to generate (default: generation.max_new_tokens)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: generation.temperature)")
    p.add_argument("--top-k", type=int, default=None, help="top-k filter, 0 = off (default: generation.top_k)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass, 1 = off (default: generation.top_p)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (default: generation.seed)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override any config key, validated like the file (repeatable), "
                        "e.g. --set speculation.gamma=6 --set draft.kind=ngram")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: text, token_ids (generated only), finish_reason, stats")
    p.add_argument("--no-stream", action="store_true", help="print the text at the end instead of streaming")


def _add_export(sub) -> None:
    from .draft.export import PRECISIONS, PROVIDERS

    p = sub.add_parser("export", aliases=["export-draft"],
                       help="export a Hugging Face checkpoint to an ONNX draft (alias: export-draft)",
                       description="Export a local Hugging Face decoder (with tokenizer.json) to ONNX with a KV "
                                   "cache using onnxruntime-genai's model builder, optionally quantized. "
                                   "Prints one progress line per stage on stderr; the builder's full output "
                                   "goes to OUT/export.log.")
    p.add_argument("--model", required=True,
                   help="Hugging Face model directory (config.json, weights, tokenizer.json), or a GGUF file "
                        "(converted once to a Hugging Face checkpoint in the cache first)")
    p.add_argument("--out", required=True, help="output directory for model.onnx and genai_config.json")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS, help="weight precision (default fp32)")
    p.add_argument("--execution-provider", default="cpu", choices=PROVIDERS,
                   help="execution provider the export targets (default cpu)")
    p.add_argument("--block-size", type=int, default=None,
                   help="int4/int8 quantization block size (16..256; builder default 32; the demo int4 uses 128)")


def _add_profile(sub) -> None:
    p = sub.add_parser("profile", help="measure this machine's costs, fit the cost model, recommend gamma",
                       description="Measure, on the configured target backend and draft: verification time of "
                                   "k = 0..16 draft tokens, the draft's time per token, transfer time against "
                                   "payload, prefill time, the draft's acceptance on calibration prompts, and "
                                   "goodput at a few gammas; each draft's cost and acceptance (--draft adds more); "
                                   "and each layout and core split this machine allows, predicted and measured. "
                                   "Fit the cost model, and write PROFILE.yaml (with the recommended gamma per "
                                   "layout, draft and layout) and PROFILE.png (goodput against gamma). Use it with "
                                   "speculation: {gamma: auto, profile: PROFILE.yaml}; runtime.mode: auto then "
                                   "takes the profile's layout costs.")
    p.add_argument("--config", required=True, help="YAML config (its target and onnx draft are measured)")
    p.add_argument("--out", required=True, help="profile to write (YAML; the plot goes next to it as .png)")
    p.add_argument("--quick", action="store_true", help="fewer points and prompts (under 2 minutes here)")
    p.add_argument("--prompts-file", default=None, metavar="FILE",
                   help='calibration prompts: JSONL, one {"prompt": "text"} or {"token_ids": [...]} per line '
                        "(default: held-out prompts)")
    p.add_argument("--draft", dest="drafts", action="append", default=[], metavar="DIR",
                   help="another ONNX draft to measure next to draft.model, e.g. another precision "
                        "(repeatable): its time per token, acceptance and best gamma")
    p.add_argument("--no-placement", action="store_true",
                   help="skip measuring each layout and core split (runtime.mode / runtime.cpus: auto)")
    p.add_argument("--no-precisions", action="store_true",
                   help="skip measuring each target precision (fp32, int8, int4 on an onnx CPU target; the first "
                        "measurement of a precision exports it once)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config key (repeatable)")


def _cmd_profile(args) -> int:
    from .config import parse_override
    from .profile_cmd import run_profile

    run_profile(Path(args.config), Path(args.out), quick=args.quick,
                prompts_file=Path(args.prompts_file) if args.prompts_file else None,
                overrides=dict(parse_override(o) for o in args.overrides),
                drafts=[Path(d) for d in args.drafts], placement=not args.no_placement,
                precisions=not args.no_precisions)
    return 0


def _add_keys(sub) -> None:
    p = sub.add_parser("keys", help="create CURVE keys for a TCP link beyond loopback (runtime.curve_keys)",
                       description="Create a directory (mode 0700) with ZeroMQ CURVE certificates: "
                                   "server.key_secret (the target) and client.key_secret (the draft worker), "
                                   "plus their public halves. Point runtime.curve_keys at it; every TCP link "
                                   "is then authenticated with these keys. Without it, TCP on loopback uses "
                                   "a fresh key pair per worker.")
    p.add_argument("--out", required=True, help="directory to create (must not hold keys already)")


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, health, metrics)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Serve the config's Engine over HTTP, OpenAI-compatible: POST /v1/completions, "
                                   "POST /v1/chat/completions (when the tokenizer has a chat template), GET "
                                   "/v1/models, GET /health (probes the target and the draft worker; 503 when "
                                   "either is down or hung) and GET /metrics (Prometheus). Streaming is "
                                   "server-sent events (stream: true). Requests are batched by the Engine. "
                                   "Binds loopback unless --host says otherwise.",
                       epilog="examples:\n"
                              "  hetero-spec serve --config configs/cpu-demo.yaml --port 8000\n"
                              "  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\\n"
                              "    -d '{\"model\": \"target\", \"prompt\": \"def parse(\", \"max_tokens\": 32, "
                              "\"temperature\": 0}'")
    p.add_argument("--config", required=True, help="YAML config file (see configs/)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the target directory's name)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config key, validated like the file (repeatable)")


def _cmd_serve(args) -> int:
    from .serve import serve

    if not 0 < args.port < 65536:
        raise ConfigError("--port", "", args.port, "must be in 1..65535")
    return serve(Path(args.config), host=args.host, port=args.port, model_name=args.model_name,
                 overrides=_overrides(args.overrides), log_level=args.log_level.lower())


def _add_load(sub) -> None:
    p = sub.add_parser("load", help="throughput and latency against concurrency (target-only and hetero_spec)",
                       description="For target-only and for the config's engine, and each concurrency level, "
                                   "client threads send the held-out prompts to one Engine: aggregate tokens/s, "
                                   "per-request latency p50/p95, time to first token, and whether outputs equal "
                                   "the first level's (greedy). The Engine decodes up to serving.max_batch "
                                   "requests together. Runs are interleaved over --repeats; ratios are paired. "
                                   "Writes OUT/load.json and OUT/load.md.")
    p.add_argument("--config", required=True, help="YAML config file (see configs/)")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated levels (default 1,2,4,8)")
    p.add_argument("--requests", type=int, default=16, help="requests per level (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved repeats of every (system, level); medians and paired ratios (default 3)")
    p.add_argument("--out", default="bench-out/load", help="output directory (default bench-out/load)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config key (repeatable)")


def _cmd_load(args) -> int:
    from .bench.load import run_load

    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        raise ConfigError("--concurrency", "", args.concurrency, "a comma-separated list of integers") from None
    if not levels or min(levels) < 1:
        raise ConfigError("--concurrency", "", args.concurrency, "levels must be >= 1")
    if args.requests < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        raise ConfigError("--requests/--max-new-tokens/--repeats", "",
                          (args.requests, args.max_new_tokens, args.repeats), "must be >= 1")
    run_load(Path(args.config), levels, args.requests, args.max_new_tokens, Path(args.out),
             overrides=_overrides(args.overrides), repeats=args.repeats)
    return 0


def _add_soak(sub) -> None:
    p = sub.add_parser("soak", help="concurrent streams against a real server: lost requests, tokens, RSS",
                       description="Start `hetero-spec serve` on a free loopback port, take a greedy reference "
                                   "answer per prompt, then keep --streams streaming completions going for "
                                   "--duration seconds: requests lost (errors, no [DONE]), outputs or usage that "
                                   "differ from the reference, and the server's RSS every second (flat: at most "
                                   "10 % growth after --warmup). The server is stopped at the end. Writes "
                                   "OUT/soak.json, OUT/soak.md and OUT/server.log; the report says whether the "
                                   "goal was met.")
    p.add_argument("--config", required=True, help="YAML config file (see configs/)")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams (default 32)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of soak (default 60)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--warmup", type=float, default=10.0,
                   help="seconds at the start that RSS growth is not judged on (default 10)")
    p.add_argument("--out", default="bench-out/soak", help="output directory (default bench-out/soak)")
    p.add_argument("--port", type=int, default=0, help="server port (default 0: a free one)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config key of the server (repeatable)")


def _cmd_soak(args) -> int:
    from .bench.soak import run_soak
    from .config import load_config

    if args.streams < 1 or args.max_tokens < 1:
        raise ConfigError("--streams/--max-tokens", "", (args.streams, args.max_tokens), "must be >= 1")
    if not args.duration > 0 or not 0 <= args.warmup < args.duration:
        raise ConfigError("--duration/--warmup", "", (args.duration, args.warmup),
                          "need duration > 0 and 0 <= warmup < duration")
    if not 0 <= args.port < 65536:
        raise ConfigError("--port", "", args.port, "must be in 0..65535 (0: a free one)")
    load_config(args.config, overrides=_overrides(args.overrides))  # a bad config fails now, not in the server
    run_soak(Path(args.config), args.streams, args.duration, args.max_tokens, args.warmup, Path(args.out),
             overrides=list(args.overrides), port=args.port)
    return 0


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def _log_level_everywhere(sub) -> None:
    """`hetero-spec generate --log-level INFO` as well as `hetero-spec --log-level INFO generate`: each command
    takes the flag too, defaulting to nothing so that the one given before the command stands."""
    for parser in sub.choices.values():
        if "--log-level" in parser._option_string_actions:  # an alias (export-draft) shares its parser
            continue
        parser.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                            help="logging level (INFO logs the resolved config)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetero-spec",
        description="Heterogeneous speculative decoding: an ONNX Runtime draft proposes tokens, the target "
                    "verifies them on the backend fastest for its device (PyTorch on CUDA, ONNX Runtime on a "
                    "CPU). Output is identical to the target alone (greedy).",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    parser.add_argument("--log-level", default="WARNING", choices=LOG_LEVELS,
                        help="logging level (INFO logs the resolved config); also accepted after COMMAND")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_export(sub)
    _add_keys(sub)
    _add_profile(sub)
    _add_serve(sub)
    _add_load(sub)
    _add_soak(sub)
    from .bench.cli import add_bench_parser

    add_bench_parser(sub)
    _log_level_everywhere(sub)
    return parser


def _read_prompt(arg: str | None) -> str:
    """--prompt, or all of standard input; either must be UTF-8 (the error names the bad byte's offset).
    Undecodable argv bytes reach Python as lone surrogates (surrogateescape), stdin is read as bytes."""
    from .validation import check_prompt_text, decode_utf8

    if arg is not None:
        return check_prompt_text(arg, "--prompt")
    if sys.stdin is None or sys.stdin.isatty():
        raise HeteroSpecError("--prompt is required when standard input is a terminal "
                              '(e.g. --prompt "def parse(", or pipe the prompt in)')
    raw = getattr(sys.stdin, "buffer", None)  # None for a text-only stream (io.StringIO)
    if raw is None:
        return check_prompt_text(sys.stdin.read(), "standard input")
    return decode_utf8(raw.read(), "standard input")


def _cmd_generate(args) -> int:
    from .config import load_config
    from .engine import Engine
    from .metrics import Stats
    from .validation import request_args

    prompt = _read_prompt(args.prompt)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed)
    config = load_config(args.config, overrides=_overrides(args.overrides))
    request_args(config, flags=True, **kw)  # bad arguments fail now, not after the models have loaded
    with Engine(config) as eng:
        if args.json:
            out = eng.generate(prompt, **kw)
            print(json.dumps(out.to_dict()))
            return 0
        stats = Stats()
        if args.no_stream:
            out = eng.generate(prompt, **kw)
            print(out.text)
            stats_d = out.stats
        else:
            pieces = eng.stream(prompt, stats=stats, **kw)  # validates the request: errors come before output
            print(prompt, end="", flush=True)  # echo the prompt, then stream the completion after it
            for piece in pieces:
                print(piece, end="", flush=True)
            print()
            stats_d = stats.to_dict()
    print(f"[{stats_d['new_tokens']} tokens, {stats_d['tokens_per_s']:.1f} tok/s, "
          f"acceptance {_rate(stats_d['acceptance_rate'])}, {stats_d['rounds']} rounds, "
          f"draft={stats_d['proposer']} gamma={stats_d['gamma']}, finish={stats_d['finish_reason']}]",
          file=sys.stderr)
    return 0


def _rate(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _cmd_export(args) -> int:
    from .draft.export import LOG_NAME, export_draft
    from .gguf_source import cached_hf, is_gguf

    model = cached_hf(args.model, "hetero-spec export", "--model", onnx=True) if is_gguf(args.model) else args.model
    out = export_draft(model, args.out, args.precision, args.execution_provider, block_size=args.block_size)
    print(f"exported {args.model} -> {out / 'model.onnx'} ({args.precision}, {args.execution_provider}); "
          f"builder log: {out / LOG_NAME}")
    from .draft.weights import weight_report

    print(weight_report(out).line())
    return 0


def _cmd_keys(args) -> int:
    from pathlib import Path

    from .transport.channel import write_keys

    out = Path(args.out)
    if any(out.glob("*.key_secret")):
        raise HeteroSpecError(f"--out {str(out)!r} already holds keys; choose a new directory")
    write_keys(out)
    print(f"wrote CURVE keys to {out}: server.key_secret, client.key_secret (keep them private); "
          f"set runtime.curve_keys: {out}")
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds `with Engine(...)`, which shuts the draft worker down


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers = {"generate": _cmd_generate, "export": _cmd_export, "export-draft": _cmd_export,
                "keys": _cmd_keys, "profile": _cmd_profile, "serve": _cmd_serve,
                "load": _cmd_load, "soak": _cmd_soak}
    try:
        if args.command == "bench":
            from .bench.cli import cmd_bench

            return cmd_bench(args)
        return handlers[args.command](args)
    except HeteroSpecError as exc:
        print(f"hetero-spec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hetero-spec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
