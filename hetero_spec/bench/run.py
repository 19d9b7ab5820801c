"""The run: start the systems, interleave them per prompt, collect their outputs."""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config, check_paths, load_config
from ..gguf_source import resolve as resolve_gguf
from ..precision import resolve_draft
from .context import CPU_FP32, WARMUP_TOKENS, BenchContext, BenchError, BenchSettings, RunOutput
from .llama_cpp import gguf_of
from .memory import ChildPeaks
from .memory import report as memory_report
from .prompts import heldout_prompt_ids, humaneval_path, humaneval_prompt_ids, prompts_from_file
from .report import build_report, write_outputs
from .systems import SYSTEMS, HeteroSpec, System

log = logging.getLogger("hetero_spec.bench")


@dataclass
class SystemResult:
    name: str
    status: str = "ok"
    reason: str | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)  # per prompt: wall_s, token_ids, stats
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ProcState:
    """The process-wide knobs a system may change in setup: CPU affinity and torch's thread count.

    The two-process engine pins the calling process to the target's cores; without putting each system's
    state back before its runs, every system run after it would be measured on fewer cores.
    """

    cpus: frozenset[int] | None
    threads: int

    @classmethod
    def capture(cls) -> ProcState:
        import torch

        cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return cls(cpus, torch.get_num_threads())

    def apply(self) -> None:
        import torch

        if self.cpus is not None and frozenset(os.sched_getaffinity(0)) != self.cpus:
            os.sched_setaffinity(0, self.cpus)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)


REFERENCE = "target_only"


def _resolve_systems(requested: list[str] | None, temperature: float = 0.0) -> list[str]:
    """--systems: exactly the systems named, in registry order. Without it: every system except those that
    run only when named (System.opt_in: the transformers fp32 ones) and, for greedy runs, hetero_spec_target_only
    (the reference of sampled runs). Speedups and identity are against target_only where it runs."""
    if requested is None:
        own_ref = temperature > 0
        return [s for s, cls in SYSTEMS.items()
                if not cls.opt_in and (s != "hetero_spec_target_only" or own_ref)]
    unknown = [s for s in requested if s not in SYSTEMS]
    if unknown:
        raise BenchError(f"--systems: unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    return [s for s in SYSTEMS if s in set(requested)]


def _say_skipped(skipped: dict[str, str]) -> None:
    """One line per reason, naming every system it skips (e.g. the four llama_cpp systems without
    --llama-cpp)."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in skipped.items():
        by_reason.setdefault(reason, []).append(name)
    for reason, names in by_reason.items():
        print(f"bench: skipping {', '.join(names)}: {reason}", file=sys.stderr, flush=True)


def _start_systems(ctx: BenchContext, names: list[str], baseline: ProcState
                   ) -> tuple[dict[str, tuple[System, ProcState]], dict[str, SystemResult]]:
    """Check, set up and warm up each system (untimed); failures become a status, not a crash.

    Each setup starts from the baseline process state; the state a system leaves is restored before its runs.
    """
    live: dict[str, tuple[System, ProcState]] = {}
    results = {n: SystemResult(n) for n in names}
    warm_prompt = ctx.prompts[0]
    skipped = {n: r for n in names if (r := SYSTEMS[n].unavailable(ctx))}
    _say_skipped(skipped)
    for i, name in enumerate(names, 1):
        cls, res = SYSTEMS[name], results[name]
        if name in skipped:
            res.status, res.reason = "skipped", skipped[name]
            continue
        system = cls()
        try:
            own_auto = issubclass(cls, HeteroSpec) and ctx.config.speculation.gamma == "auto"  # keeps auto
            calib = (", gamma auto" if own_auto else f", calibrating gamma over {list(ctx.gammas)}") \
                if ctx.gammas and cls.acceptance_keys else ""
            print(f"bench: setting up {name} ({i}/{len(names)}{calib})", file=sys.stderr, flush=True)
            baseline.apply()
            t = time.perf_counter()
            system.setup(ctx)
            res.extra["setup_s"] = round(time.perf_counter() - t, 3)
            t = time.perf_counter()
            system.run(warm_prompt, min(WARMUP_TOKENS, ctx.max_new))
            res.extra["warmup_s"] = round(time.perf_counter() - t, 3)
        except Exception as exc:  # any engine's failure is reported, the others still run
            if name == REFERENCE:
                raise BenchError(f"the target_only reference failed: {type(exc).__name__}: {exc}") from exc
            res.status, res.reason = "unavailable", f"{type(exc).__name__}: {exc}"
            log.warning("%s unavailable: %s", name, res.reason)
            _close(system)
            continue
        state = ProcState.capture()
        res.extra.update(cpus=sorted(state.cpus) if state.cpus is not None else None, torch_threads=state.threads)
        res.extra.update(system.describe(ctx))
        live[name] = (system, state)
    baseline.apply()
    return live, results


def _close(system: System) -> None:
    try:
        system.close()
    except Exception as exc:  # closing must never hide the results
        log.warning("closing %s: %s", system.name, exc)


def _interleave(ctx: BenchContext, live: dict[str, tuple[System, ProcState]],
                 results: dict[str, SystemResult], repeats: int = 1) -> None:
    """Per prompt, each live system `repeats` times, each in the process state it set up. The order of the
    systems rotates from prompt to prompt (and repeat to repeat), so that no system always runs right after
    the same neighbour (whose caches and clocks it would inherit). With repeats > 1 a prompt's time is the
    median of its repeats (the output must be the same every time)."""
    from tqdm import tqdm

    names = list(live)
    if not names:
        return
    bar = tqdm(total=len(ctx.prompts) * len(names) * repeats, desc="bench", unit="run", file=sys.stderr,
               dynamic_ncols=True)
    try:
        for i, prompt in enumerate(ctx.prompts):
            walls: dict[str, list[float]] = {n: [] for n in names}
            outs: dict[str, RunOutput] = {}
            for r in range(repeats):
                shift = (i * repeats + r) % len(names)
                for name in names[shift:] + names[:shift]:
                    if name not in live:
                        continue
                    bar.set_postfix_str(f"prompt {i + 1}/{len(ctx.prompts)} {name}")
                    out = _timed_run(ctx, live, results, name, i, prompt, walls)
                    if out is not None:
                        if name in outs and outs[name].token_ids != out.token_ids:
                            res = results[name]
                            if quantized_target(ctx.config):  # rounding differs with the block's shape
                                res.extra["changed_between_repeats"] = res.extra.get("changed_between_repeats", 0) + 1
                            else:
                                res.status, res.reason = "failed", f"prompt {i}: output changed between repeats"
                                _close(live.pop(name)[0])
                                continue
                        outs.setdefault(name, out)
                    bar.update(1)
            for name, out in outs.items():
                if name in live:
                    results[name].runs.append({"wall_s": statistics.median(walls[name]), "token_ids": out.token_ids,
                                               "stats": out.stats, "repeats_s": walls[name]})
    finally:
        bar.close()


def quantized_target(config: Config) -> bool:
    """An int8/int4 target rounds a verified block differently from a one-token step (precision.py): speculative
    output then equals the target's own only up to near-ties, and may change from run to run as gamma does. That
    is reported, not failed; its bound is the teacher-forced log-probability gap the tests assert."""
    return config.target.precision in ("int8", "int4")


def _timed_run(ctx: BenchContext, live: dict[str, tuple[System, ProcState]], results: dict[str, SystemResult],
               name: str, i: int, prompt: list[int], walls: dict[str, list[float]]) -> RunOutput | None:
    system, state = live[name]
    state.apply()
    t = time.perf_counter()
    try:
        out = system.run(prompt, ctx.max_new)
    except Exception as exc:
        if name == REFERENCE:
            raise BenchError(f"target_only failed on prompt {i}: {exc}") from exc
        res = results[name]
        res.status, res.reason = "failed", f"prompt {i}: {type(exc).__name__}: {exc}"
        _close(live.pop(name)[0])
        return None
    elapsed = time.perf_counter() - t
    own = out.own_wall_s  # a system that timed itself (llama.cpp: without its process start and model load)
    walls[name].append(own if own is not None else elapsed)
    return out


def run_bench(settings: BenchSettings, prompt_ids: list[list[int]] | None = None) -> dict[str, Any]:
    """Run the benchmark and write bench.json, bench.md and bench.png under settings.out.

    prompt_ids replaces the held-out prompts (tests use it with tiny models). Returns the bench.json dict.
    """
    sampling = {"speculation.sampling": settings.sampling} if settings.sampling else {}
    config = load_config(settings.config, overrides={**settings.overrides, **sampling, **CPU_FP32})
    check_paths(config)
    given = config  # the models as named: a .gguf there is also what the llama_cpp systems run
    config = resolve_draft(resolve_gguf(config))  # GGUF models: their conversions; a Hugging Face draft with
    # draft.precision: its cached export (peers read it)
    names = _resolve_systems(settings.systems, settings.temperature)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    draft_hf = settings.draft_hf if settings.draft_hf is not None else default_draft_hf(settings.config)
    t = time.perf_counter()
    prompt_ids, n_prompts, source = _prompts(settings, config, prompt_ids)
    log.info("%d prompts ready in %.1f s", len(prompt_ids), time.perf_counter() - t)
    prompts = [list(p) for p in prompt_ids[:n_prompts]]
    if not prompts or any(not p for p in prompts):
        raise BenchError("no prompts to benchmark (or an empty prompt)")
    context = context_len(config)
    longest = max(len(p) for p in prompts)
    if context is not None and longest + settings.max_new > context:
        raise BenchError(f"prompts of {longest} tokens + {settings.max_new} new tokens exceed the target's "
                         f"context of {context}: lower --prompt-tokens or --max-new-tokens (otherwise the "
                         "systems would stop at different lengths)")
    original = ProcState.capture()
    threads = config.target.threads or original.threads
    ctx = BenchContext(config=config, overrides=dict(settings.overrides), out=out, draft_hf=draft_hf,
                       prompts=prompts, max_new=settings.max_new, torch_threads=threads,
                       ort_target=settings.ort_target, temperature=settings.temperature,
                       gammas=settings.gammas, llama_cpp=settings.llama_cpp,
                       llama_cpp_target=settings.llama_cpp_target or gguf_of(given.target.model),
                       llama_cpp_draft=settings.llama_cpp_draft or (gguf_of(given.draft.model)
                                                                    if given.draft.kind != "none" else None))
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # generate() warns per call about generation_config defaults
    live: dict[str, tuple[System, ProcState]] = {}
    children = ChildPeaks().start()  # the draft worker's and llama.cpp's peak memory, while they run
    try:
        live, results = _start_systems(ctx, names, ProcState(original.cpus, threads))
        _interleave(ctx, live, results, settings.repeats)
    finally:
        for name, (system, _) in live.items():
            results[name].extra.update(system.extra())
            _close(system)
        original.apply()
        hf_logging.set_verbosity(verbosity)
        child_peaks = children.stop()
    report = build_report(settings, ctx, results, prompts_source={**source, "available": len(prompt_ids)},
                          memory=memory_report(child_peaks))
    write_outputs(out, report)
    return report


def _prompts(settings: BenchSettings, config: Config, given: list[list[int]] | None
             ) -> tuple[list[list[int]], int, dict[str, Any]]:
    """(prompt ids, how many to use, where they came from: {"kind": given | file | humaneval | held-out, ...})."""
    if given is not None:
        return given, settings.n_prompts, {"kind": "given"}
    if settings.humaneval:
        ids = humaneval_prompt_ids(config, settings.prompts)
        return ids, len(ids), {"kind": "humaneval", "path": str(humaneval_path())}
    if settings.prompts_file is not None:
        ids = prompts_from_file(settings.prompts_file, config)
        return ids, settings.prompts or len(ids), {"kind": "file", "path": str(settings.prompts_file)}
    ids = heldout_prompt_ids(config, settings.config, settings.n_prompts, settings.prompt_tokens)
    return ids, settings.n_prompts, {"kind": "held-out", "prompt_tokens": settings.prompt_tokens}


def context_len(config: Config) -> int | None:
    """The target's context: target.max_context or the model's max_position_embeddings (None if unknown)."""
    raw = json.loads((config.target.model / "config.json").read_text())
    sizes = [x for x in (raw.get("max_position_embeddings") or raw.get("n_positions"), config.target.max_context)
             if x]
    return int(min(sizes)) if sizes else None


def default_draft_hf(config_path: Path) -> Path | None:
    """models/draft two levels above the config (configs/cpu-demo.yaml -> models/draft), if present."""
    cand = Path(config_path).resolve().parent.parent / "models" / "draft"
    return cand if (cand / "config.json").is_file() else None
