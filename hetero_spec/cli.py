"""`hetero-spec` command line. A face of the engine: it parses arguments and calls the API, nothing more."""

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from . import __version__
from .config import load_config, parse_override
from .draft.export import LOG_NAME, PRECISIONS, PROVIDERS, export_draft
from .draft.weights import weight_report
from .errors import ConfigError, HeteroSpecError
from .gguf_source import cached_hf, is_gguf
from .metrics import Stats
from .validation import check_prompt_text, request_args

EPILOG = """examples:
  hetero-spec generate --model models/target --draft models/draft --prompt "def parse(" --max-new-tokens 64
  hetero-spec serve --model target.gguf --draft draft.gguf --port 8000
  hetero-spec bench --model models/target --draft models/draft --quick
  hetero-spec generate --config configs/cpu-demo.yaml --prompt "def parse(" --max-new-tokens 64
  hetero-spec generate --config configs/cpu-demo.yaml --prompt "import os" --set speculation.gamma=6 --json
  echo "def parse(" | hetero-spec generate --config configs/cpu-demo.yaml --set draft.kind=ngram
  hetero-spec export --model models/draft --out /tmp/draft-int4 --precision int4 --block-size 128
  hetero-spec profile --config configs/cpu-demo.yaml --out profiles/cpu.yaml --quick
  hetero-spec generate --config configs/cpu-demo.yaml --set speculation.gamma=auto --prompt "def f("
  hetero-spec bench --config configs/cpu-demo.yaml --out bench-out --repeats 2
  hetero-spec serve --config configs/cpu-demo.yaml --port 8000
"""
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]
CONFIG_HELP = "YAML config file (see configs/)"
MODEL_HELP = ("the target: a GGUF file, a Hugging Face checkpoint directory or an ONNX export (target.model); with no "
              "--config, the backend, gamma, layout and core split are chosen by measurement (docs/configuration.md)")
DRAFT_HELP = ("the draft: a GGUF file, a Hugging Face checkpoint (exported once at draft.precision, default int8), an "
              "ONNX export, or ngram (prompt lookup, the default) or none (the target alone)")


def _command(sub, name: str, run, help: str, config: str | None = CONFIG_HELP,
             overrides: str | None = "override a config key, validated like the file (repeatable)",
             models: bool = True, **parser_options):
    """Add a subcommand's parser, which runs `run(args)` and is described by run's docstring, with --config and
    --set unless their help is None, and --model and --draft when `models` (without which --config is required);
    return its add_argument for the command's own options."""
    description = " ".join((run.__doc__ or "").split())  # one paragraph, as argparse shows it (None: python -OO)
    parser = sub.add_parser(name, help=help, description=description, **parser_options)
    parser.set_defaults(run=run, model=None, draft=None)
    if config:
        if models:
            add_model_flags(parser.add_argument)
        parser.add_argument("--config", required=not models, help=f"{config}; --model and --draft override it"
                            if models else config)
    if overrides:
        parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                            help=overrides)
    return parser.add_argument


def add_model_flags(add) -> None:
    """--model and --draft on a command's parser (its add_argument)."""
    add("--model", metavar="FILE.gguf|DIR", help=MODEL_HELP)
    add("--draft", metavar="FILE.gguf|DIR|ngram|none", help=DRAFT_HELP)


def model_flags(args) -> dict[str, Any]:
    """--model and --draft as config overrides (before --set's, which win)."""
    flags: dict[str, Any] = {}
    if args.model is not None:
        _require(Path(args.model).exists(), "--model", args.model, "no such file or directory")
        flags["target.model"] = str(Path(args.model).resolve())
    if args.draft in ("ngram", "none"):
        flags["draft.kind"] = args.draft
    elif args.draft is not None:
        draft = Path(args.draft)
        _require(draft.exists(), "--draft", args.draft, "no such file or directory, and not ngram or none")
        flags |= {"draft.kind": "onnx", "draft.model": str(draft.resolve())}
        if (draft / "model.onnx").is_file():
            flags["draft.precision"] = None  # an export has its own precision
    return flags


def overrides(args) -> dict[str, Any]:
    """The config overrides of a command's --model, --draft and --set; without --config, the target must be named."""
    merged = model_flags(args) | dict(map(parse_override, args.overrides))
    if args.config is None and "target.model" not in merged:
        raise ConfigError("--model", "", None, "required without --config: the target, a GGUF file, a Hugging Face "
                          "checkpoint directory or an ONNX export (or give --config FILE)")
    return merged


def _require(holds: bool, flag: str, value: Any, why: str) -> None:
    if not holds:
        raise ConfigError(flag, "", value, why)


def _add_generate(sub) -> None:
    arg = _command(sub, "generate", _cmd_generate, "generate a completion with speculative decoding",
                   overrides="override any config key, validated like the file (repeatable), e.g. --set "
                   "speculation.gamma=6 --set draft.kind=ngram",
                   formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    arg("--prompt", help="prompt text; read from standard input when omitted and stdin is not a terminal")
    arg("--max-new-tokens", type=int, help="most tokens to generate (default: generation.max_new_tokens)")
    arg("--temperature", type=float, help="0 = greedy (default: generation.temperature)")
    arg("--top-k", type=int, help="top-k filter, 0 = off (default: generation.top_k)")
    arg("--top-p", type=float, help="nucleus mass, 1 = off (default: generation.top_p)")
    arg("--seed", type=int, help="seed for sampling (default: generation.seed)")
    arg("--json", action="store_true",
        help="print one JSON object: text, token_ids (generated only), finish_reason, stats")
    arg("--no-stream", action="store_true", help="print the text at the end instead of streaming")


def _add_export(sub) -> None:
    arg = _command(sub, "export", _cmd_export,
                   "export a Hugging Face checkpoint to an ONNX draft (alias: export-draft)", config=None,
                   overrides=None, aliases=["export-draft"])
    arg("--model", required=True, help="Hugging Face model directory (config.json, weights, "
        "tokenizer.json), or a GGUF file (converted once to a Hugging Face checkpoint in the cache first)")
    arg("--out", required=True, help="output directory for model.onnx and genai_config.json")
    arg("--precision", default="fp32", choices=PRECISIONS, help="weight precision (default fp32)")
    arg("--execution-provider", default="cpu", choices=PROVIDERS,
        help="execution provider the export targets (default cpu)")
    arg("--block-size", type=int,
        help="int4/int8 quantization block size (16..256; builder default 32; the demo int4 uses 128)")


def _add_keys(sub) -> None:
    arg = _command(sub, "keys", _cmd_keys, "create CURVE keys for a TCP link beyond loopback (runtime.curve_keys)",
                   config=None, overrides=None)
    arg("--out", required=True, help="directory to create (must not hold keys already)")


def _add_draft_worker(sub) -> None:
    arg = _command(sub, "draft-worker", _cmd_draft_worker, "run a draft worker on this host for a remote target",
                   config=None, overrides=None, formatter_class=argparse.RawDescriptionHelpFormatter,
                   epilog="example (docs/features-two-process.md, \"Draft workers on other hosts\"):\n"
                          "  hetero-spec draft-worker --connect tcp://10.0.0.5:5555 --keys keys/ --model draft-onnx/")
    arg("--connect", required=True, metavar="tcp://HOST:PORT", help="the target's runtime.host:port")
    arg("--keys", required=True, metavar="DIR", help="directory with client.key_secret and server.key")
    arg("--model", required=True, metavar="DIR", help="exported ONNX draft (`hetero-spec export`)")
    arg("--threads", type=int, default=1, help="ONNX Runtime threads (default 1)")
    arg("--providers", default="CPUExecutionProvider", help="comma-separated execution providers")
    arg("--vocab-width", type=int, default=0, help="the target's logits width, if the draft's differs")
    arg("--max-streams", type=int, default=64, help="requests drafted for at once (default 64)")


def _cmd_draft_worker(args) -> int:
    """Load an ONNX draft and draft for a target on another host: connect to its runtime.host:port (the target runs
    runtime.mode: two_process with runtime.worker: remote) over TCP with CURVE, using the keys of a `hetero-spec keys`
    directory (client.key_secret and the target's server.key). The worker outlives its targets: when the target
    restarts, it connects again. It exits on SIGTERM or Ctrl-C, or with code 2 when the target refuses its key."""
    from .runtime import draft_worker
    _require(args.connect.startswith("tcp://"), "--connect", args.connect, "must be tcp://HOST:PORT")
    _require(Path(args.keys).is_dir(), "--keys", args.keys, "no such directory (make one with `hetero-spec keys`)")
    for name in ("client.key_secret", "server.key"):
        _require((Path(args.keys) / name).is_file(), "--keys", args.keys,
                 f"no {name} in this directory (a worker needs client.key_secret and the target's server.key, "
                 "from a `hetero-spec keys` directory)")
    from .transport.channel import worker_keys
    try:
        worker_keys(args.keys)  # a file that is there but holds no key: one line now, not a traceback later
    except ValueError as exc:
        raise ConfigError("--keys", "", args.keys, " ".join(str(exc).split(": ", 1)[-1].split())) from None
    _require((Path(args.model) / "model.onnx").is_file(), "--model", args.model, "no model.onnx in this directory")
    return draft_worker.main(["--endpoint", args.connect, "--keys", args.keys, "--model", args.model,
                              "--threads", str(args.threads), "--providers", args.providers,
                              "--vocab-width", str(args.vocab_width), "--max-streams", str(args.max_streams)])


def _add_profile(sub) -> None:
    arg = _command(sub, "profile", _cmd_profile, "measure this machine's costs, fit the cost model, recommend gamma",
                   config="YAML config (its target and onnx draft are measured)", models=False)
    arg("--out", required=True, type=Path, help="profile to write (YAML; the plot goes next to it as .png)")
    arg("--quick", action="store_true", help="fewer points and prompts (under 2 minutes here)")
    arg("--prompts-file", metavar="FILE", type=Path, help='calibration prompts: JSONL, one {"prompt": "text"} or '
        '{"token_ids": [...]} per line (default: held-out prompts)')
    arg("--draft", dest="drafts", action="append", default=[], type=Path, metavar="DIR", help="another ONNX draft to "
        "measure next to draft.model, e.g. another precision (repeatable): its time per token, acceptance and best "
        "gamma")
    arg("--no-placement", action="store_true",
        help="skip measuring each layout and core split (runtime.mode / runtime.cpus: auto)")
    arg("--no-precisions", action="store_true", help="skip measuring each target precision (fp32, int8, int4 on an "
        "onnx CPU target; the first measurement of a precision exports it once)")


def _add_serve(sub) -> None:
    arg = _command(sub, "serve", _cmd_serve, "an OpenAI-compatible HTTP server (completions, chat, health, metrics)",
                   formatter_class=argparse.RawDescriptionHelpFormatter,
                   epilog="examples:\n"
                          "  hetero-spec serve --config configs/cpu-demo.yaml --port 8000\n"
                          "  hetero-spec serve --config configs/cpu-demo.yaml --ray --set serving.ray.num_replicas=2\n"
                          "  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\\n"
                          "    -d '{\"model\": \"target\", \"prompt\": \"def parse(\", \"max_tokens\": 32, "
                          "\"temperature\": 0}'")
    arg("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    arg("--port", type=int, default=8000, help="port (default 8000)")
    arg("--model-name", help="the model id clients send (default: the target directory's name)")
    arg("--ray", action="store_true", help="deploy on Ray Serve: serving.ray.num_replicas Engines (or autoscaling) "
        "behind Serve's HTTP proxy, each replica on its own cores (needs the 'ray' extra; docs/serving.md)")
    arg("--address", help="with --ray: the Ray cluster to join (auto, ray://HOST:10001); default "
        "serving.ray.address, else a local Ray instance")


def _add_load(sub) -> None:
    arg = _command(sub, "load", _cmd_load, "throughput and latency against concurrency (target-only and hetero_spec)",
                   models=False)
    arg("--concurrency", default="1,2,4,8", help="comma-separated levels (default 1,2,4,8)")
    arg("--requests", type=int, default=16, help="requests per level (default 16)")
    arg("--max-new-tokens", type=int, default=64, help="tokens per request (default 64)")
    arg("--repeats", type=int, default=3,
        help="interleaved repeats of every (system, level); medians and paired ratios (default 3)")
    arg("--out", default="bench-out/load", help="output directory (default bench-out/load)")


def _add_soak(sub) -> None:
    arg = _command(sub, "soak", _cmd_soak, "concurrent streams against a real server: lost requests, tokens, RSS",
                   overrides="override a config key of the server (repeatable)", models=False)
    arg("--streams", type=int, default=32, help="concurrent streams (default 32)")
    arg("--duration", type=float, default=60.0, help="seconds of soak (default 60)")
    arg("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    arg("--warmup", type=float, default=10.0, help="seconds at the start that RSS growth is not judged on (default 10)")
    arg("--out", default="bench-out/soak", help="output directory (default bench-out/soak)")
    arg("--port", type=int, default=0, help="server port (default 0: a free one)")
    arg("--cut-share", type=float, default=1 / 3,
        help="share of requests whose client goes away after the first event (default 1/3)")
    arg("--malformed-share", type=float, default=0.1, help="share of malformed requests, each expecting its 400 "
        "or 404 (default 0.1); /metrics must count exactly these")


def build_parser() -> argparse.ArgumentParser:
    from .bench.cli import add_bench_parser, cmd_bench
    parser = argparse.ArgumentParser(
        prog="hetero-spec", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Heterogeneous speculative decoding: an ONNX Runtime draft proposes tokens, the target verifies "
                    "them on the backend fastest for its device (PyTorch on CUDA, ONNX Runtime on a CPU). Output is "
                    "identical to the target alone (greedy).")
    parser.add_argument("--log-level", default="WARNING", choices=LOG_LEVELS,
                        help="logging level (INFO logs the resolved config); also accepted after COMMAND")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_generate, _add_export, _add_keys, _add_draft_worker, _add_profile, _add_serve, _add_load,
                _add_soak):
        add(sub)
    add_bench_parser(sub)
    sub.choices["bench"].set_defaults(run=cmd_bench)
    # `hetero-spec generate --log-level INFO` as well as `hetero-spec --log-level INFO generate`: each command
    # takes the flag too, defaulting to nothing so that the one given before the command stands
    for command in {id(p): p for p in sub.choices.values()}.values():  # an alias (export-draft) shares its parser
        command.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                             help="logging level (INFO logs the resolved config)")
    return parser


def _read_prompt(arg: str | None) -> str:
    """--prompt, or all of standard input; either must be UTF-8 (the error names the bad byte's offset).
    Undecodable bytes reach Python as lone surrogates (surrogateescape): argv's as Python decodes it, stdin's as
    its bytes are decoded here."""
    if arg is not None:
        return check_prompt_text(arg, "--prompt")
    if sys.stdin is None or sys.stdin.isatty():
        raise HeteroSpecError("--prompt is required when standard input is a terminal "
                              '(e.g. --prompt "def parse(", or pipe the prompt in)')
    raw = getattr(sys.stdin, "buffer", None)  # None: a text-only stream (io.StringIO)
    text = sys.stdin.read() if raw is None else raw.read().decode("utf-8", "surrogateescape")
    return check_prompt_text(text, "standard input")


def _cmd_generate(args) -> None:
    """Generate a completion. Greedy output (temperature 0) is token-identical to the target model alone; sampled
    output keeps its distribution."""
    from .engine import Engine
    prompt = _read_prompt(args.prompt)
    sampling = {name: getattr(args, name) for name in ("max_new_tokens", "temperature", "top_k", "top_p", "seed")}
    config = load_config(args.config, overrides=overrides(args))
    request_args(config, flags=True, **sampling)  # bad arguments fail now, not after the models have loaded
    with Engine(config) as eng:
        if args.json:
            print(json.dumps(eng.generate(prompt, **sampling).to_dict()))
            return
        if args.no_stream:
            out = eng.generate(prompt, **sampling)
            print(out.text)
            summary = out.stats
        else:
            stats = Stats()
            pieces = eng.stream(prompt, stats=stats, **sampling)  # validates the request: errors come before output
            print(prompt, end="", flush=True)  # echo the prompt, then stream the completion after it
            for piece in pieces:
                print(piece, end="", flush=True)
            print()
            summary = stats.to_dict()
    rate = "n/a" if summary["acceptance_rate"] is None else f"{summary['acceptance_rate']:.2f}"
    print("[{new_tokens} tokens, {tokens_per_s:.1f} tok/s, acceptance {rate}, {rounds} rounds, draft={proposer} "
          "gamma={gamma}, finish={finish_reason}]".format_map({**summary, "rate": rate}), file=sys.stderr)


def _cmd_export(args) -> None:
    """Export a local Hugging Face decoder (with tokenizer.json) to ONNX with a KV cache using onnxruntime-genai's
    model builder, optionally quantized. Prints one progress line per stage on stderr; the builder's full output goes
    to OUT/export.log."""
    model = cached_hf(args.model, "hetero-spec export", "--model", onnx=True) if is_gguf(args.model) else args.model
    out = export_draft(model, args.out, args.precision, args.execution_provider, block_size=args.block_size)
    print(f"exported {args.model} -> {out / 'model.onnx'} ({args.precision}, {args.execution_provider}); "
          f"builder log: {out / LOG_NAME}")
    print(weight_report(out).line())


def _cmd_keys(args) -> None:
    """Create a directory (mode 0700) with ZeroMQ CURVE certificates: server.key_secret (the target) and
    client.key_secret (the draft worker), plus their public halves. Point runtime.curve_keys at it; every TCP link is
    then authenticated with these keys. Without it, TCP on loopback uses a fresh key pair per worker."""
    from .transport.channel import CurveKeys, key_fingerprint, write_keys
    out = Path(args.out)
    if any(out.glob("*.key_secret")):
        raise HeteroSpecError(f"--out {str(out)!r} already holds keys; choose a new directory")
    keys = CurveKeys.load(write_keys(out))
    print(f"wrote CURVE keys to {out}: server.key_secret, client.key_secret (keep them private); "
          f"set runtime.curve_keys: {out}\nfingerprints (as the logs name them): server "
          f"{key_fingerprint(keys.server_public)}, client {key_fingerprint(keys.client_public)}")


def _cmd_profile(args) -> None:
    """Measure, on the configured target backend and draft: verification time of k = 0..16 draft tokens, the draft's
    time per token, transfer and prefill time, acceptance on calibration prompts and goodput at a few gammas; the same
    for each --draft and target precision; and each layout and core split this machine allows, predicted and
    measured. Write PROFILE.yaml (the fitted cost model, recommended gamma, draft, layout and precision) and
    PROFILE.png (goodput against gamma). Use it with speculation: {gamma: auto, profile: PROFILE.yaml}."""
    from .profile_cmd import run_profile
    run_profile(Path(args.config), args.out, quick=args.quick, prompts_file=args.prompts_file,
                overrides=overrides(args), drafts=args.drafts, placement=not args.no_placement,
                precisions=not args.no_precisions)


def _cmd_serve(args) -> int:
    """Serve the config's Engine over HTTP, OpenAI-compatible: POST /v1/completions, POST /v1/chat/completions (when
    the tokenizer has a chat template), GET /v1/models, GET /health (probes the target and the draft worker; 503 when
    either is down or hung) and GET /metrics (Prometheus). Streaming is server-sent events (stream: true). Requests
    are batched by the Engine. Binds loopback unless --host says otherwise."""
    from .serve import serve
    _require(0 < args.port < 65536, "--port", args.port, "must be in 1..65535")
    _require(args.ray or args.address is None, "--address", args.address, "only with --ray")
    if args.ray:
        from .serve.ray_serve import serve_ray
        return serve_ray(load_config(args.config, overrides=overrides(args)), host=args.host,
                         port=args.port, address=args.address, model_name=args.model_name)
    return serve(args.config, host=args.host, port=args.port, model_name=args.model_name,
                 overrides=overrides(args), log_level=args.log_level.lower())


def _cmd_load(args) -> None:
    """For target-only and for the config's engine, and each concurrency level, client threads send the held-out
    prompts to one Engine: aggregate tokens/s, per-request latency p50/p95, time to first token, and whether outputs
    equal the first level's (greedy). The Engine decodes up to serving.max_batch requests together. Runs are
    interleaved over --repeats; ratios are paired. Writes OUT/load.json and OUT/load.md."""
    from .bench.load import run_load
    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        raise ConfigError("--concurrency", "", args.concurrency, "a comma-separated list of integers") from None
    _require(levels and min(levels) >= 1, "--concurrency", args.concurrency, "levels must be >= 1")
    _require(min(args.requests, args.max_new_tokens, args.repeats) >= 1, "--requests/--max-new-tokens/--repeats",
             (args.requests, args.max_new_tokens, args.repeats), "must be >= 1")
    run_load(Path(args.config), levels, args.requests, args.max_new_tokens, Path(args.out),
             overrides=overrides(args), repeats=args.repeats)


def _cmd_soak(args) -> None:
    """Start `hetero-spec serve` on a free loopback port, take a greedy reference answer per prompt, then keep
    --streams streaming completions going for --duration seconds, a share of them cut by their client and a share
    malformed: requests lost (errors, no [DONE], a malformed request answered otherwise than expected), outputs or
    usage that differ from the reference, the server's RSS every second (flat: at most 10 % growth after --warmup),
    and /metrics against what was sent (every error counted, nothing left in flight). The server is stopped at the
    end. Writes OUT/soak.json, OUT/soak.md and OUT/server.log; the report says whether the goal was met."""
    from .bench.soak import run_soak
    _require(min(args.streams, args.max_tokens) >= 1, "--streams/--max-tokens", (args.streams, args.max_tokens),
             "must be >= 1")
    _require(args.duration > 0 and 0 <= args.warmup < args.duration, "--duration/--warmup",
             (args.duration, args.warmup), "need duration > 0 and 0 <= warmup < duration")
    _require(0 <= args.port < 65536, "--port", args.port, "must be in 0..65535 (0: a free one)")
    _require(0 <= args.cut_share and 0 <= args.malformed_share and args.cut_share + args.malformed_share < 1,
             "--cut-share/--malformed-share", (args.cut_share, args.malformed_share),
             "need shares >= 0 whose sum is below 1 (the rest are whole requests)")
    load_config(args.config, overrides=overrides(args))  # a bad config fails now, not in the server
    run_soak(Path(args.config), args.streams, args.duration, args.max_tokens, args.warmup, Path(args.out),
             overrides=list(args.overrides), port=args.port, cut_share=args.cut_share,
             malformed_share=args.malformed_share)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds `with Engine(...)`, which shuts the draft worker down


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args) or 0  # a command returns its exit status, or None for 0
    except HeteroSpecError as exc:
        print(f"hetero-spec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hetero-spec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
