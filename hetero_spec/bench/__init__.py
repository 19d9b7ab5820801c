"""`hetero-spec bench`: the engine side by side with its baselines, on the same prompts and machine.

Modules: context (settings, shared context), systems (the registry; the reference, transformers and
hetero_spec systems), ort_genai (ONNX Runtime GenAI systems), llama_cpp (llama.cpp's tools on GGUF files),
prompts (held-out, --prompts-file, HumanEval), run (interleaving), memory (peak RSS), report (summaries and
outputs), cli, tuning_bench (`--scenario`: gamma sweep, repetitive text, useless draft; tuning.json/.md),
precision_bench (`--precision-matrix`).

Every system decodes the same prompts (token ids, so every system sees identical inputs; llama.cpp gets them
as text) greedily, interleaved per prompt (A B C A B C ...) so that machine noise hits all systems alike. Each
system gets one untimed warm-up first. Results land in DIR/bench.json (schema below), DIR/bench.md and
DIR/bench.png.

The reference is target_only: the configured target alone (the engine with draft.kind none, in process, at the
config's backend, precision and threads). --systems runs exactly the systems it names, so name target_only too
for speedups and identity; without --systems every system runs except the transformers fp32 ones
(hf_target_only, hf_assisted, hf_assisted_best_const: System.opt_in), which run only when named.

Systems are a registry: a name -> a small class with `setup(ctx)`, `run(prompt_ids, max_new) -> RunOutput`
and `close()`, plus `unavailable(ctx)`, which says why the system cannot run here (or None). Adding a
system is registering one more class.

bench.json, top level: machine, versions, config (resolved), settings (with prompts_source and reference),
systems (a list, one entry per system, in run order), analytic, pipelined_vs_in_process, comparisons, memory
(peak RSS of the bench process and of each child process). Each system entry:
    name, status ("ok" | "skipped" | "unavailable" | "failed"), reason (why not ok, else null),
    tokens_per_s (median over prompts), speedup_vs_target_only (median of per-prompt time ratios; null without
    the reference), acceptance_rate (null where meaningless), identical_to_target_only, per_prompt (raw: wall_s,
    new_tokens, tokens_per_s, speedup_vs_target_only, identical_to_target_only, stats), extra.
ORT GenAI systems also carry identical_to_ort_genai_target_only, llama.cpp's identical_to_llama_cpp_target_only
(System.peer_reference).
"""

from __future__ import annotations

from . import ort_genai as _ort_genai  # noqa: F401  (registers its systems after the others)
from . import llama_cpp as _llama_cpp  # noqa: F401  (then llama.cpp's)
from .cli import run_bench_cli, settings_from_args
from .context import BenchContext, BenchError, BenchSettings, RunOutput
from .report import analytic, build_report, pipelined_vs_in_process, render_markdown, summarize
from .run import SystemResult, run_bench
from .systems import SYSTEMS, System, register
from .tuning_bench import SCENARIOS, ScenarioSettings, run_tuning

__all__ = ["SCENARIOS", "SYSTEMS", "BenchContext", "BenchError", "BenchSettings", "RunOutput", "ScenarioSettings",
           "System", "SystemResult", "analytic", "build_report", "pipelined_vs_in_process", "register",
           "render_markdown", "run_bench", "run_bench_cli", "run_tuning", "settings_from_args", "summarize"]
