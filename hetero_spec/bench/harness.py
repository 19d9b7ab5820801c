"""The bench harness: settings, the system registry, interleaved timing, pairing, the report and its files.

A system is a registered class (`@register`; registry order is run order) with `setup(ctx)`, `run(prompt_ids,
max_new) -> RunOutput`, `close()`, `describe(ctx)` and `unavailable(ctx)` (why it cannot run here, or None).
`run_bench` sets up the systems asked for (each warmed up once, untimed), runs them on the same prompts with
`interleave`, pairs each prompt by prompt (`pair`) with its references (target_only; a peer's own target alone;
hetero_spec_target_only for sampled runs) and our systems with the peers (`comparisons`: every peer, and the
fastest of them, the best peer), and writes OUT/bench.json and OUT/bench.md. A precision matrix runs the same
pass once per (target precision, draft precision). `hetero-spec load` and `soak` share `interleave`, `table`
and `write_report`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config, check_paths, load_config
from ..errors import HeteroSpecError

REFERENCE, SAMPLED_REFERENCE = "target_only", "hetero_spec_target_only"
DEFAULT_PROMPTS, DEFAULT_MAX_NEW, QUICK_PROMPTS, QUICK_MAX_NEW = 12, 128, 4, 64
DEFAULT_PROMPT_TOKENS, WARMUP_TOKENS, SEED = 128, 16, 0
DEFAULT_GAMMAS = (4, 6, 8, 10, 12)
PRECISIONS = ("fp32", "int8", "int4")
CPU_FP32 = {"target.device": "cpu", "target.dtype": "float32"}  # every system computes in fp32 on the CPU


class BenchError(HeteroSpecError):
    """The benchmark cannot run as asked; the message names the bad value."""


@dataclass
class BenchSettings:
    """What to run; None means the default (12 prompts x 128 tokens, 4 x 64 with quick)."""

    config: Path
    out: Path
    prompts: int | None = None  # held-out prompts, or the first N of prompts_file / HumanEval
    max_new_tokens: int | None = None
    systems: list[str] | None = None  # exactly these, in registry order; None: all but the opt-in ones
    quick: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)  # --set, for every system (peers read target.*)
    draft_hf: Path | None = None  # the draft's Hugging Face checkpoint (hf_assisted)
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    ort_target: Path | None = None  # an ONNX export of the target for ORT GenAI; None: exported under out
    temperature: float = 0.0  # above 0 our systems sample (seed SEED), against hetero_spec_target_only
    sampling: str | None = None  # speculation.sampling of our systems; None: the config's
    gammas: tuple[int, ...] | None = None  # calibration candidates of every speculative system; None: the config's
    repeats: int = 1
    prompts_file: Path | None = None
    humaneval: bool = False
    llama_cpp: Path | None = None  # llama.cpp's binaries; None: its systems are skipped
    llama_cpp_target: Path | None = None
    llama_cpp_draft: Path | None = None
    precision_matrix: tuple[tuple[str, ...], tuple[str, ...] | None] | None = None  # (targets, drafts or None)

    @property
    def n_prompts(self) -> int:
        return self.prompts or (QUICK_PROMPTS if self.quick else DEFAULT_PROMPTS)

    @property
    def max_new(self) -> int:
        return self.max_new_tokens or (QUICK_MAX_NEW if self.quick else DEFAULT_MAX_NEW)

    @property
    def passes(self) -> list[dict[str, str]]:
        """Each pass's config overrides: the precision matrix's (target.precision, draft.precision), else [{}]."""
        if not self.precision_matrix:
            return [{}]
        targets, drafts = self.precision_matrix
        return [{"target.precision": t, **({"draft.precision": d} if d else {})} for t in targets
                for d in (drafts or [None])]


@dataclass
class RunOutput:
    """A system's output for one prompt: generated ids, its stats (accepted / drafted / rounds where it drafts),
    and, for a system that times itself (llama.cpp, without its process start and model load), prefill_s and
    decode_s, whose sum then replaces the bench's clock."""

    token_ids: list[int]
    stats: dict[str, Any] | None = None
    prefill_s: float | None = None
    decode_s: float | None = None

    @property
    def own_wall_s(self) -> float | None:
        return None if self.prefill_s is None or self.decode_s is None else self.prefill_s + self.decode_s


@dataclass
class BenchContext:
    """What every system sees: the resolved config (--set, --sampling, CPU fp32, the pass's precisions)."""

    config: Config
    out: Path
    prompts: list[list[int]]
    max_new: int
    gammas: tuple[int, ...] | None = None
    temperature: float = 0.0
    draft_hf: Path | None = None
    ort_target: Path | None = None
    llama_cpp: Path | None = None
    llama_cpp_target: Path | None = None
    llama_cpp_draft: Path | None = None
    _tokenizer: Any = None

    @property
    def gamma(self) -> int:
        """The config's gamma; 8 where it is auto, for the peers that need a number."""
        g = self.config.speculation.gamma
        return g if isinstance(g, int) else 8

    @property
    def calibration_prompts(self) -> list[list[int]]:
        return self.prompts[:2]

    def tokenizer(self):
        if self._tokenizer is None:
            from .prompts import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.target.model)
        return self._tokenizer


class System:
    """A benchmarked system; the first paragraph of a subclass's docstring is its `--help` line."""

    name = "?"
    ours = False  # this project's engine (else a peer)
    speculative = True  # it drafts (else a target alone)
    opt_in = False  # runs only when named in --systems
    peer_reference: str | None = None  # a peer's own target alone: identical_to_<it> as well
    calibration: dict | None = None  # seconds per calibrated setting, when it was calibrated

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        return None

    def setup(self, ctx: BenchContext) -> None:
        raise NotImplementedError

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        raise NotImplementedError

    def describe(self, ctx: BenchContext) -> dict[str, Any]:
        """backend, layout, target_threads, draft_threads, gamma: shown in bench.json and bench.md."""
        return {}

    def close(self) -> None:
        pass


SYSTEMS: dict[str, type[System]] = {}


def register(cls: type[System]) -> type[System]:
    if cls.name in SYSTEMS:
        raise ValueError(f"system {cls.name!r} is registered twice")
    SYSTEMS[cls.name] = cls
    return cls


def cores() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def thread_options() -> tuple[int, ...]:
    """The thread counts a peer is calibrated over: one (per model), and every core."""
    return tuple(dict.fromkeys((1, cores())))


def calibrate(run: Callable[[Any, list[int], int], RunOutput], candidates: Sequence, prompts: list[list[int]],
              max_new: int) -> tuple[Any, dict[Any, float]]:
    """Give a system its best setting (gamma, threads) before it is compared: time each candidate on the
    calibration prompts (untimed for the report; a run that timed itself counts by its own clock) and keep the
    fastest. Returns (the best, seconds per candidate)."""
    times: dict[Any, float] = {}
    for c in candidates:
        times[c] = 0.0
        for p in prompts:
            t = time.perf_counter()
            own = run(c, p, max_new).own_wall_s
            times[c] += own if own is not None else time.perf_counter() - t
    return min(times, key=times.get), times


@dataclass(frozen=True)
class ProcState:
    """CPU affinity and torch's thread count. A two-process engine pins this process to the target's cores:
    each system runs in the state its setup left, and the next setup starts from the first state."""

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


def interleave(names: Sequence[str], prompts: Sequence, repeats: int, run: Callable[[str, Any], Any],
               must: Sequence[str] = (), say: Callable[[str], None] | None = None,
               clock: Callable[[], float] = time.perf_counter) -> tuple[dict[str, list], dict[str, str]]:
    """Run every name on every prompt `repeats` times, interleaved: the order rotates from prompt to prompt and
    repeat to repeat, so that no system always runs right after the same neighbour (machine noise hits all
    alike). run(name, prompt) returns the output; a RunOutput's own_wall_s, when set, is its time, else the
    clock around run. A name whose run raises is dropped for the rest, its error kept; one in `must` stops all.
    Returns ({name: [[(seconds, output) per repeat] per prompt]}, {name: error})."""
    names = list(names)
    runs: dict[str, list] = {n: [] for n in names}
    failed: dict[str, str] = {}
    start = clock()
    for i, prompt in enumerate(prompts):
        done: dict[str, list] = {n: [] for n in names}
        for r in range(repeats):
            shift = (i * repeats + r) % len(names) if names else 0
            for n in names[shift:] + names[:shift]:
                if n in failed:
                    continue
                t = clock()
                try:
                    out = run(n, prompt)
                except Exception as exc:  # one system's failure is reported, the others go on
                    if n in must:
                        raise BenchError(f"{n} failed on prompt {i}: {type(exc).__name__}: {exc}") from exc
                    failed[n] = f"prompt {i}: {type(exc).__name__}: {exc}"
                    continue
                own = getattr(out, "own_wall_s", None)
                done[n].append((own if own is not None else clock() - t, out))
        for n in names:
            if n not in failed:
                runs[n].append(done[n])
        if say is not None:
            say(f"prompt {i + 1}/{len(prompts)} done ({clock() - start:.0f} s)")
    return {n: v for n, v in runs.items() if n not in failed}, failed


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    """a's tokens/s over b's on one prompt; with the same token count, b's time over a's."""
    n, m = a["new_tokens"], b["new_tokens"]
    return b["wall_s"] / a["wall_s"] if n == m or not n or not m else (n / a["wall_s"]) / (m / b["wall_s"])


def pair(ours: Sequence[dict[str, Any]], ref: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Two systems' per-prompt results from one pass (wall_s, new_tokens, token_ids_hash), prompt by prompt:
    the median of ours' throughput over ref's, its range, the prompts ours won, identical outputs."""
    if len(ours) != len(ref) or not ours:
        return None
    r = [_ratio(a, b) for a, b in zip(ours, ref)]
    return {"median": round(statistics.median(r), 4), "min": round(min(r), 4), "max": round(max(r), 4),
            "won": sum(x > 1.0 for x in r), "prompts": len(r),
            "identical": sum(a["token_ids_hash"] == b["token_ids_hash"] for a, b in zip(ours, ref))}


# -- one pass -------------------------------------------------------------------------------------------------
def resolve_systems(requested: list[str] | None, temperature: float = 0.0) -> list[str]:
    """--systems: exactly those named, in registry order. Without it: every system but the opt-in ones and,
    when greedy, the sampled reference."""
    if requested is None:
        return [n for n, c in SYSTEMS.items() if not c.opt_in and (n != SAMPLED_REFERENCE or temperature > 0)]
    if unknown := [s for s in requested if s not in SYSTEMS]:
        raise BenchError(f"--systems: unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    return [s for s in SYSTEMS if s in requested]


def _entry(name: str, status: str, reason: str | None, extra: dict | None = None, per_prompt=()) -> dict:
    return {"name": name, "status": status, "reason": reason, "tokens_per_s": None, "acceptance_rate": None,
            "tokens_per_round": None, "per_prompt": list(per_prompt), "extra": extra or {}}


def per_prompt(runs: list) -> list[dict[str, Any]]:
    """interleave's runs of one system -> per prompt: the median of the repeats' times, the first one's output
    (its hash) and stats, and whether every repeat gave the same output (stable)."""
    pp = []
    for reps in runs:
        walls, first = [w for w, _ in reps], reps[0][1]
        wall, n = statistics.median(walls), len(first.token_ids)
        pp.append({"wall_s": round(wall, 6), "repeats_s": [round(w, 6) for w in walls], "new_tokens": n,
                   "tokens_per_s": round(n / wall, 3) if wall > 0 else None,
                   "token_ids_hash": hashlib.sha1(str(list(first.token_ids)).encode()).hexdigest()[:12],
                   "stats": first.stats, "stable": all(o.token_ids == first.token_ids for _, o in reps)})
    return pp


def _measured(name: str, runs: list, extra: dict, quantized: bool) -> dict[str, Any]:
    """A system's entry from its runs."""
    e = _entry(name, "ok", None, extra, pp := per_prompt(runs))
    if changed := [i for i, p in enumerate(pp) if not p["stable"]]:
        if quantized:  # an int8/int4 target rounds a verified block unlike a one-token step: reported, not failed
            e["extra"]["changed_between_repeats"] = len(changed)
        else:
            e.update(status="failed", reason=f"prompt {changed[0]}: output changed between repeats")
    stats = [p["stats"] or {} for p in pp]
    drafted, rounds = (sum(s.get(k) or 0 for s in stats) for k in ("drafted", "rounds"))
    rates = [p["tokens_per_s"] for p in pp if p["tokens_per_s"] is not None]
    e["tokens_per_s"] = round(statistics.median(rates), 3) if rates else None
    if drafted and SYSTEMS[name].speculative:
        e["acceptance_rate"] = round(sum(s.get("accepted") or 0 for s in stats) / drafted, 4)
    e["tokens_per_round"] = round(sum(p["new_tokens"] for p in pp) / rounds, 3) if rounds else None
    return e


def _close(system: System) -> None:
    try:
        system.close()
    except Exception as exc:  # closing must never hide the results
        print(f"bench: closing {system.name}: {exc}", file=sys.stderr)


def run_pass(ctx: BenchContext, names: list[str], repeats: int, say: Callable[[str], None]) -> list[dict]:
    """Set up and warm up each system (untimed; what cannot run becomes a status, except the reference), run
    them interleaved, close them. Returns their bench.json entries."""
    baseline = ProcState.capture()
    skipped = {n: r for n in names if (r := SYSTEMS[n].unavailable(ctx))}
    for reason in dict.fromkeys(skipped.values()):
        say(f"skipping {', '.join(n for n, r in skipped.items() if r == reason)}: {reason}")
    entries = {n: _entry(n, "skipped", r) for n, r in skipped.items()}
    live: dict[str, tuple[System, ProcState, float]] = {}
    try:
        for i, name in enumerate(names, 1):
            if name in skipped:
                continue
            say(f"setting up {name} ({i}/{len(names)})")
            system, t = SYSTEMS[name](), time.perf_counter()
            baseline.apply()
            try:
                system.setup(ctx)
                system.run(ctx.prompts[0], min(WARMUP_TOKENS, ctx.max_new))
            except Exception as exc:  # any system's failure is reported, the others still run
                _close(system)
                if name == REFERENCE:
                    raise BenchError(f"the target_only reference failed: {type(exc).__name__}: {exc}") from exc
                entries[name] = _entry(name, "unavailable", f"{type(exc).__name__}: {exc}")
                continue
            live[name] = (system, ProcState.capture(), round(time.perf_counter() - t, 3))
        baseline.apply()

        def run(name: str, prompt: list[int]) -> RunOutput:
            live[name][1].apply()
            return live[name][0].run(prompt, ctx.max_new)

        runs, failed = interleave(list(live), ctx.prompts, repeats, run, must=(REFERENCE,), say=say)
        quantized = ctx.config.target.precision in ("int8", "int4")
        for name, (system, state, setup_s) in live.items():
            extra = {"setup_s": setup_s, "cpus": sorted(state.cpus) if state.cpus else None, **system.describe(ctx)}
            if system.calibration:
                extra["calibration_s"] = {" ".join(str(x) for x in (k if isinstance(k, tuple) else (k,)) if x is not None):
                                          round(v, 4) for k, v in system.calibration.items()}
            entries[name] = _entry(name, "failed", failed[name], extra) if name in failed else \
                _measured(name, runs[name], extra, quantized)
    finally:
        for system, _, _ in live.values():
            _close(system)
        baseline.apply()
    return [entries[n] for n in names if n in entries]


def with_references(entries: list[dict], sampled: bool) -> None:
    """speedup_vs_<ref> and identical_to_<ref> (prompts) of each entry against its references: target_only,
    its peer_reference, and for our speculative systems when sampled, hetero_spec_target_only."""
    ok = {e["name"]: e for e in entries if e["status"] == "ok"}
    for e in entries:
        cls = SYSTEMS[e["name"]]
        extra = (cls.peer_reference, SAMPLED_REFERENCE if sampled and cls.ours and cls.speculative else None)
        for ref in [REFERENCE, *(r for r in extra if r and r != e["name"])]:
            p = pair(e["per_prompt"], ok[ref]["per_prompt"]) if e["status"] == "ok" and ref in ok else None
            e[f"speedup_vs_{ref}"], e[f"identical_to_{ref}"] = (p["median"], p["identical"]) if p else (None, None)


def comparisons(entries: list[dict]) -> list[dict[str, Any]]:
    """Our systems against the peers, paired per prompt: each of our speculative systems against the best peer
    (the fastest by median tokens/s), our first one against every speculative peer, and target_only against
    every peer's target alone."""
    ok = {e["name"]: e for e in entries if e["status"] == "ok" and e["tokens_per_s"]}
    ours = [n for n in ok if SYSTEMS[n].ours and SYSTEMS[n].speculative]
    peers = [n for n in ok if not SYSTEMS[n].ours]
    best = max(peers, key=lambda n: ok[n]["tokens_per_s"], default=None)
    todo = [(n, best, "best peer") for n in ours if best]
    todo += [((ours or [None])[0] if SYSTEMS[p].speculative else REFERENCE, p, "") for p in peers]
    out, seen = [], set()
    for name, peer, note in todo:
        if name in ok and (name, peer) not in seen and (p := pair(ok[name]["per_prompt"], ok[peer]["per_prompt"])):
            seen.add((name, peer))
            out.append({"system": name, "peer": peer, "note": note, **p})
    return out


# -- the run --------------------------------------------------------------------------------------------------
def _prompts(s: BenchSettings, config: Config, given: list[list[int]] | None) -> tuple[list[list[int]], dict]:
    """(the prompts, where they came from: {"kind": given | file | humaneval | held-out, ...})."""
    from . import prompts as P

    if given is not None:
        ids, source = given[:s.n_prompts], {"kind": "given", "available": len(given)}
    elif s.humaneval:
        ids, source = P.humaneval_prompt_ids(config, s.prompts), {"kind": "humaneval", "path": str(P.humaneval_path())}
    elif s.prompts_file is not None:
        every = P.prompts_from_file(s.prompts_file, config)
        ids, source = every[:s.prompts or None], {"kind": "file", "path": str(s.prompts_file), "available": len(every)}
    else:
        ids = P.heldout_prompt_ids(config, s.config, s.n_prompts, s.prompt_tokens)
        source = {"kind": "held-out", "prompt_tokens": s.prompt_tokens}
    if not ids or any(not p for p in ids):
        raise BenchError("no prompts to benchmark (or an empty prompt)")
    return [list(p) for p in ids], source


def context_len(config: Config) -> int | None:
    """The target's context: target.max_context or the model's max_position_embeddings (None if unknown)."""
    raw = json.loads((Path(config.target.model) / "config.json").read_text())
    sizes = [x for x in (raw.get("max_position_embeddings") or raw.get("n_positions"), config.target.max_context) if x]
    return int(min(sizes)) if sizes else None


def default_draft_hf(config_path: Path) -> Path | None:
    """models/draft two levels above the config (configs/cpu-demo.yaml -> models/draft), if present."""
    cand = Path(config_path).resolve().parent.parent / "models" / "draft"
    return cand if (cand / "config.json").is_file() else None


def run_bench(settings: BenchSettings, prompt_ids: list[list[int]] | None = None) -> dict[str, Any]:
    """Run the benchmark (each pass of the precision matrix, or one pass) and write OUT/bench.json and
    OUT/bench.md. prompt_ids replaces the held-out prompts (tests). Returns the bench.json dict."""
    from transformers.utils import logging as hf_logging

    from ..gguf_source import resolve as resolve_gguf
    from ..precision import resolve_draft
    from .llama_cpp import gguf_of
    from .memory import ChildPeaks, memory_report

    s, out = settings, Path(settings.out)
    names = resolve_systems(s.systems, s.temperature)
    base = {**s.overrides, **({"speculation.sampling": s.sampling} if s.sampling else {}), **CPU_FP32}
    given = load_config(s.config, overrides=base)  # a .gguf named here is also what llama.cpp runs
    check_paths(given)
    configs = [resolve_draft(resolve_gguf(load_config(s.config, overrides={**base, **p}))) for p in s.passes]
    prompts, source = _prompts(s, configs[0], prompt_ids)
    context, longest = context_len(configs[0]), max(map(len, prompts))
    if context is not None and longest + s.max_new > context:
        raise BenchError(f"prompts of {longest} tokens + {s.max_new} new tokens exceed the target's context of "
                         f"{context}: lower --prompt-tokens or --max-new-tokens")
    out.mkdir(parents=True, exist_ok=True)

    def say(text: str) -> None:
        print(f"bench: {text}", file=sys.stderr, flush=True)

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # generate() warns per call about generation_config defaults
    children, passes = ChildPeaks().start(), []
    try:
        for over, config in zip(s.passes, configs):
            if over:
                say("pass: " + ", ".join(f"{k} {v}" for k, v in over.items()))
            ctx = BenchContext(config=config, out=out, prompts=prompts, max_new=s.max_new, gammas=s.gammas,
                               temperature=s.temperature, ort_target=s.ort_target, llama_cpp=s.llama_cpp,
                               draft_hf=s.draft_hf or default_draft_hf(s.config),
                               llama_cpp_target=s.llama_cpp_target or gguf_of(given.target.model),
                               llama_cpp_draft=s.llama_cpp_draft or (gguf_of(given.draft.model)
                                                                     if given.draft.kind != "none" else None))
            entries = run_pass(ctx, names, s.repeats, say)
            with_references(entries, s.temperature > 0)
            passes.append({"precision": over, "systems": entries, "comparisons": comparisons(entries)})
    finally:
        hf_logging.set_verbosity(verbosity)
        peaks = children.stop()
    ran_ref = any(e["name"] == REFERENCE and e["status"] == "ok" for p in passes for e in p["systems"])
    report: dict[str, Any] = {
        "machine": machine(), "versions": versions(),
        "config": {"source": given.source, **given.model_dump(mode="json")},
        "settings": {"command": command_line(s), "prompts": len(prompts), "prompts_source": source,
                     "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": s.max_new, "repeats": s.repeats,
                     "gamma": given.speculation.gamma, "gammas": list(s.gammas) if s.gammas else None,
                     "temperature": s.temperature, "sampling": given.speculation.sampling, "seed": SEED,
                     "quick": s.quick, "overrides": s.overrides, "reference": REFERENCE if ran_ref else None,
                     "precision_matrix": [list(x) if x else None for x in s.precision_matrix] if s.precision_matrix
                     else None},
        "memory": memory_report(peaks)}
    report.update({"passes": passes} if s.precision_matrix else {k: passes[0][k] for k in ("systems", "comparisons")})
    write_report(out, "bench", report, render_markdown(report))
    return report


def command_line(s: BenchSettings) -> str:
    """The `hetero-spec bench` command that repeats this run."""
    prompts = ("humaneval" + (f":{s.prompts}" if s.prompts else "")) if s.humaneval else str(s.n_prompts)
    parts = ["hetero-spec", "bench", "--config", str(s.config), "--out", str(s.out), "--prompts", prompts,
             "--max-new-tokens", str(s.max_new), "--repeats", str(s.repeats),
             "--gammas", ",".join(map(str, s.gammas)) if s.gammas else "config"]
    matrix = s.precision_matrix and ",".join(s.precision_matrix[0]) + (
        "/" + ",".join(s.precision_matrix[1]) if s.precision_matrix[1] else "")
    for flag, value in (("--systems", ",".join(s.systems or [])), ("--prompts-file", s.prompts_file),
                        ("--prompt-tokens", s.prompt_tokens if s.prompt_tokens != DEFAULT_PROMPT_TOKENS else None),
                        ("--temperature", s.temperature or None), ("--sampling", s.sampling),
                        ("--precision-matrix", matrix), ("--draft-hf", s.draft_hf), ("--ort-target", s.ort_target),
                        ("--llama-cpp", s.llama_cpp), ("--llama-cpp-target", s.llama_cpp_target),
                        ("--llama-cpp-draft", s.llama_cpp_draft)):
        if value:
            parts += [flag, str(value)]
    for k, v in s.overrides.items():
        parts += ["--set", f"{k}={v if isinstance(v, str) else json.dumps(v)}"]
    return shlex.join(parts + (["--quick"] if s.quick else []))


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "onnxruntime", "onnxruntime-genai", "hetero-spec"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def machine() -> dict[str, Any]:
    model = platform.processor() or None
    try:
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), model)
    except OSError:
        pass
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "cpu_model": model}


# -- outputs --------------------------------------------------------------------------------------------------
def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """Markdown table lines."""
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header)] + [f"| {' | '.join(map(str, r))} |" for r in rows]


def write_report(out: Path, stem: str, report: dict[str, Any], markdown: str) -> None:
    """OUT/STEM.json (every number) and OUT/STEM.md."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)


def fmt(x: Any, spec: str = ".3f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _prompts_text(s: dict[str, Any]) -> str:
    src, n = s["prompts_source"], s["prompts"]
    plural = "s" if n != 1 else ""
    of = f" (the first {n} of {src['available']})" if src.get("available") not in (None, n) else ""
    return {"file": f"{n} prompt{plural} from the file {src.get('path')}{of}",
            "humaneval": f"{n} HumanEval prompt{plural}",
            "held-out": f"{n} held-out prompt{plural} of {src.get('prompt_tokens')} tokens"}.get(
        src["kind"], f"{n} given prompt{plural}{of}")


def _pass_markdown(p: dict[str, Any]) -> list[str]:
    rows = []
    for e in p["systems"]:
        if e["status"] == "skipped":
            continue
        x, notes = e["extra"], [] if e["status"] == "ok" else [f"{e['status']}: {e['reason']}"]
        for key, n in e.items():
            ref = key[len("identical_to_"):]
            if key.startswith("identical_to_") and ref != REFERENCE and n is not None:
                notes.append(f"{fmt(e[f'speedup_vs_{ref}'], '.2f')}x {ref}, identical on {n} of "
                             f"{len(e['per_prompt'])} prompts")
        if x.get("changed_between_repeats"):
            notes.append(f"output changed between repeats on {x['changed_between_repeats']} prompt(s) (int8/int4)")
        threads = fmt(x.get("target_threads"), "") + (f" + {x['draft_threads']}" if x.get("draft_threads") else "")
        ident = e.get("identical_to_target_only")
        rows.append([e["name"], x.get("backend", "-"), x.get("layout", "-"), threads, fmt(x.get("gamma"), ""),
                     fmt(e["tokens_per_s"], ".1f"), fmt(e.get("speedup_vs_target_only"), ".2f") + "x",
                     fmt(e["acceptance_rate"]), "-" if ident is None else f"{ident}/{len(e['per_prompt'])}",
                     "; ".join(notes)])
    lines = table(["system", "backend", "layout", "threads", "gamma", "tok/s", "speedup vs target_only",
                   "acceptance", "identical to target_only", "notes"], rows)
    if not any(e["name"] == REFERENCE and e["status"] == "ok" for e in p["systems"]):
        lines += ["", "No reference: target_only did not run, so there are no speedups; add it to --systems."]
    skipped: dict[str, list[str]] = {}
    for e in p["systems"]:
        if e["status"] == "skipped":
            skipped.setdefault(e["reason"], []).append(e["name"])
    lines += [""] * bool(skipped) + [f"- skipped {', '.join(n)}: {r}" for r, n in skipped.items()]
    if p["comparisons"]:
        lines += ["", "Paired per prompt (the peer's time / ours, median over prompts):", "",
                  *table(["ours", "peer", "median", "range", "faster on", "identical outputs"],
                         [[c["system"], c["peer"] + (f" ({c['note']})" if c["note"] else ""), f"{c['median']:.2f}x",
                           f"{c['min']:.2f}-{c['max']:.2f}", f"{c['won']}/{c['prompts']}",
                           f"{c['identical']}/{c['prompts']}"] for c in p["comparisons"]])]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    s, m = report["settings"], report["machine"]
    decoding = "greedy" if not s["temperature"] else \
        f"our systems sampled at temperature {s['temperature']} ({s['sampling']}, seed {s['seed']}), peers greedy"
    gamma = f"gamma calibrated per system over {s['gammas']}" if s["gammas"] else f"gamma {s['gamma']}"
    lines = ["# hetero-spec bench", "", f"`{s['command']}`", "",
             f"{_prompts_text(s)} x {s['max_new_tokens']} new tokens, {decoding}, {gamma}, {m['cpu_count']} CPUs "
             f"({m['cpu_model']}); interleaved per prompt, the order rotating, after one untimed warm-up per "
             f"system; a prompt's time is the median of {s['repeats']} run(s).", ""]
    for p in report.get("passes") or [report]:
        if p.get("precision"):
            lines += ["", "## " + ", ".join(f"{k} {v}" for k, v in p["precision"].items()), ""]
        lines += _pass_markdown(p)
    if mem := report.get("memory"):
        kids = ", ".join(f"{k} {v:,.0f} MB" for k, v in mem["children"].items()) or "none"
        lines += ["", f"Peak memory (RSS high-water mark): bench process {mem['peak_rss_mb']:,.0f} MB (every system "
                      f"in it, loaded together); child processes, each its own peak: {kids}."]
    return "\n".join(lines) + "\n"
