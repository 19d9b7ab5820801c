"""The bench harness: `run_bench` sets up the systems asked for (each warmed up, untimed), runs them on the same
prompts with `interleave`, pairs each prompt by prompt (`pair`) with its references and ours with the peers
(`comparisons`), writes OUT/bench.json and bench.md; a precision matrix runs that pass once per precision."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..config import Config, load_config
from ..preflight import check_paths
from ..errors import BenchError
from ..tuning.placement import _cpu_model, allowed_cpus

REFERENCE, SAMPLED_REFERENCE = "target_only", "hetero_spec_target_only"
DEFAULT_PROMPTS, DEFAULT_MAX_NEW, QUICK_PROMPTS, QUICK_MAX_NEW = 12, 128, 4, 64
DEFAULT_PROMPT_TOKENS, WARMUP_TOKENS, SEED = 128, 16, 0
CALIBRATION_ROUNDS = 2  # tune(): rounds of timing each candidate, the fastest round counting
DEFAULT_GAMMAS = (4, 6, 8, 10, 12)
PRECISIONS = ("fp32", "int8", "int4")
CPU_FP32 = {"target.device": "cpu", "target.dtype": "float32"}  # every system computes in fp32 on the CPU
ALONE = {"draft.kind": "none", "draft.candidates": [], "runtime.mode": "in_process"}  # our target alone
cores = allowed_cpus  # the CPUs this process may run on
SYSTEMS: dict[str, type[System]] = {}  # every System subclass with a name, in run order


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
    draft_hf: Path | None = None  # the draft's Hugging Face checkpoint (hf_assisted); None: draft.model if one
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    ort_target: Path | None = None  # an ONNX export of the target for ORT GenAI; None: the onnx backend's
    temperature: float = 0.0  # above 0 our systems sample (seed SEED), against hetero_spec_target_only
    sampling: str | None = None  # speculation.sampling of our systems; None: the config's
    gammas: tuple[int, ...] | None = None  # calibration candidates of every speculative system; None: the config's
    repeats: int = 1
    prompts_file: Path | None = None
    humaneval: bool = False
    mtbench: bool = False  # MT-Bench's chat turns (prompts: how many questions), reported per category
    llama_cpp: Path | None = None  # llama.cpp's binaries; None: its systems are skipped
    llama_cpp_target: Path | None = None  # None: target.model if it is a GGUF
    llama_cpp_draft: Path | None = None
    precision_matrix: tuple[str, ...] | None = None  # target precisions: one pass each

    @property
    def n_prompts(self) -> int:
        return self.prompts or (QUICK_PROMPTS if self.quick else DEFAULT_PROMPTS)

    @property
    def max_new(self) -> int:
        return self.max_new_tokens or (QUICK_MAX_NEW if self.quick else DEFAULT_MAX_NEW)


@dataclass
class RunOutput:
    """One prompt's generated ids, stats (accepted, drafted, rounds where it drafts), own time (llama.cpp)."""

    token_ids: list[int]
    stats: dict[str, Any] | None = None
    own_wall_s: float | None = None


@dataclass
class BenchContext:
    """What a system sees: the pass's resolved config, the prompts, and the settings' fields (gammas, out, ...)."""

    settings: BenchSettings
    config: Config
    prompts: list[list[int]]

    def __getattr__(self, name: str) -> Any:
        if name == "settings":  # not set yet
            raise AttributeError(name)
        return getattr(self.settings, name)


class System:
    """A benchmarked system: setup(ctx) loads it, run() decodes a prompt (by _run with its setting), describe(ctx)
    says what ran (backend, layout, target_threads, draft_threads, gamma), close() frees it. A subclass that sets
    `name` is registered (in SYSTEMS, whose order is run order); its docstring's first paragraph is its --help."""

    name = "?"
    ours = False  # this project's engine, else a peer
    speculative = True  # it drafts, else a target alone
    opt_in = False  # runs only when named in --systems
    peer_reference: str | None = None  # a peer's own target alone: identical_to_<it> too
    setting: Any = None  # what run() passes to _run: its gamma, (threads, gamma), ...
    calibration: dict | None = None  # seconds per calibrated setting

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            SYSTEMS[cls.name] = cls

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        return None

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        return self._run(self.setting, prompt_ids, max_new)

    def close(self) -> None:
        pass


def quiesce(limit_s: float = 0.3, slice_s: float = 0.02) -> None:
    """Wait until this process uses no CPU for a slice (at most limit_s), before a timed run: ONNX Runtime's pool
    threads spin for about 40 ms after a run, and a system timed while its predecessor's threads still spin shares
    the cores with them (on the demo pair, a 64-token run of one system right after another's: 0.81-0.92x)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = sum(os.times()[:2])
        time.sleep(slice_s)
        if sum(os.times()[:2]) - before < slice_s / 4:
            return


def timed(run: Callable[..., Any], *args: Any, clock: Callable[[], float] = time.perf_counter) -> tuple[float, Any]:
    """(seconds, run(*args)): the output's own_wall_s (a RunOutput's own clock) when set, else the clock around it."""
    started = clock()
    out = run(*args)
    own = getattr(out, "own_wall_s", None)
    return (clock() - started if own is None else own), out


def tune(system: System, ctx: BenchContext, run: Callable[..., RunOutput], candidates: Sequence,
         rounds: int = CALIBRATION_ROUNDS) -> Any:
    """A system's best setting before it is compared: warm up, time each candidate on the first two prompts (by
    `timed`) in each of `rounds` rounds, the candidates interleaved per prompt with the order rotating, and keep the
    fastest. A candidate's time is its fastest round: a burst of other load slows a round and never speeds one, so
    one burst cannot hand a peer (or us) a worse setting. The times go to system.calibration."""
    if len(candidates) < 2:
        return candidates[0]
    run(candidates[0], ctx.prompts[0], min(WARMUP_TOKENS, ctx.max_new))
    names = list(candidates)
    per_round = {c: [0.0] * rounds for c in names}
    for r in range(rounds):
        for i, prompt in enumerate(ctx.prompts[:2]):
            shift = (r * 2 + i) % len(names)
            for c in names[shift:] + names[:shift]:
                quiesce()
                per_round[c][r] += timed(run, c, prompt, ctx.max_new)[0]  # timed later too
    times = {c: min(v) for c, v in per_round.items()}
    system.calibration = {" ".join(str(x) for x in (c if isinstance(c, tuple) else (c,)) if x is not None):
                          round(v, 4) for c, v in times.items()}
    return min(times, key=times.get)


def proc_state(state: tuple | None = None) -> tuple:
    """This process's (CPU affinity, torch threads); with a state, set them first. A two-process engine pins this
    process to the target's cores: each system runs in the state its setup left, each setup from the first."""
    import torch
    if state is not None:
        if state[0] is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, state[0])
        torch.set_num_threads(state[1])
    return (frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None, torch.get_num_threads())


def interleave(names: Sequence, prompts: Sequence, repeats: int, run: Callable[[Any, Any], Any],
               must: Sequence = (), say: Callable[[str], None] = lambda text: None,
               clock: Callable[[], float] = time.perf_counter,
               settle: Callable[[], None] = lambda: None) -> tuple[dict[Any, list], dict[Any, str]]:
    """Run every name on every prompt `repeats` times, interleaved: the order rotates from prompt to prompt and
    repeat to repeat, so that no system always runs right after the same neighbour (and machine noise hits all
    alike). run(name, prompt) -> its output, `timed`, each after settle(), untimed. A name whose run raises is
    dropped, its error kept; one in
    `must` stops everything. Returns ({name: [[(seconds, output) per repeat] per prompt]}, {name: error})."""
    names, failed, start = list(names), {}, clock()
    runs: dict[Any, list] = {n: [[] for _ in prompts] for n in names}  # per prompt, its repeats
    for index, prompt in enumerate(prompts):
        for repeat in range(repeats):
            shift = (index * repeats + repeat) % len(names) if names else 0
            for name in [n for n in names[shift:] + names[:shift] if n not in failed]:
                try:
                    settle()
                    runs[name][index].append(timed(run, name, prompt, clock=clock))
                except Exception as exc:  # one system's failure is reported, the others go on
                    if name in must:
                        raise BenchError(f"{name} failed on prompt {index}: {type(exc).__name__}: {exc}") from exc
                    failed[name] = f"prompt {index}: {type(exc).__name__}: {exc}"
        say(f"prompt {index + 1}/{len(prompts)} done ({clock() - start:.0f} s)")
    return {n: v for n, v in runs.items() if n not in failed}, failed


def per_prompt(runs: list) -> list[dict[str, Any]]:
    """interleave's runs of a system -> per prompt: the repeats' median time, the first one's output and stats."""
    results = []
    for reps in runs:
        walls, first = [w for w, _ in reps], reps[0][1]
        wall, new_tokens = statistics.median(walls), len(first.token_ids)
        results.append({"wall_s": round(wall, 6), "repeats_s": [round(w, 6) for w in walls], "new_tokens": new_tokens,
                        "tokens_per_s": round(new_tokens / wall, 3) if wall > 0 else None,
                        "token_ids_hash": hashlib.sha1(str(list(first.token_ids)).encode()).hexdigest()[:12],
                        "stats": first.stats, "stable": all(o.token_ids == first.token_ids for _, o in reps)})
    return results


def pair(ours: Sequence[dict], ref: Sequence[dict]) -> dict[str, Any] | None:
    """Two systems' per_prompt results of one pass, prompt by prompt: median, range and wins of ours' tokens/s over
    ref's (ref's time over ours with equal token counts), and identical outputs."""
    if len(ours) != len(ref) or not ours:
        return None
    ratios = [b["wall_s"] / a["wall_s"] if (n := a["new_tokens"]) == (m := b["new_tokens"]) or not n * m
              else n / a["wall_s"] / (m / b["wall_s"]) for a, b in zip(ours, ref)]
    return {"median": round(statistics.median(ratios), 4), "min": round(min(ratios), 4), "max": round(max(ratios), 4),
            "won": sum(x > 1.0 for x in ratios), "prompts": len(ratios),
            "identical": sum(a["token_ids_hash"] == b["token_ids_hash"] for a, b in zip(ours, ref))}


def resolve_systems(requested: list[str] | None, temperature: float = 0.0) -> list[str]:
    """--systems: exactly those, in registry order; else all but the opt-in ones (and, greedy, the sampled one)."""
    if requested is None:
        return [n for n, c in SYSTEMS.items() if not c.opt_in and (n != SAMPLED_REFERENCE or temperature > 0)]
    if unknown := [s for s in requested if s not in SYSTEMS]:
        raise BenchError(f"--systems: unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    return [s for s in SYSTEMS if s in requested]


def _entry(name: str, status: str, reason: str | None, extra: dict | None = None, rows: list | None = None) -> dict:
    return {"name": name, "status": status, "reason": reason, "tokens_per_s": None, "acceptance_rate": None,
            "tokens_per_round": None, "per_prompt": rows or [], "extra": {} if extra is None else extra}


def _measured(name: str, runs: list, extra: dict, quantized: bool) -> dict[str, Any]:
    """A system's entry from its runs (an output changing between repeats fails it, unless the target is int8
    or int4: it rounds a verified block unlike a one-token step, so that is counted)."""
    entry = _entry(name, "ok", None, extra, rows := per_prompt(runs))
    if (changed := [i for i, p in enumerate(rows) if not p["stable"]]) and quantized:
        entry["extra"]["changed_between_repeats"] = len(changed)
    elif changed:
        entry.update(status="failed", reason=f"prompt {changed[0]}: output changed between repeats")
    stats, rates = [p["stats"] or {} for p in rows], [p["tokens_per_s"] for p in rows if p["tokens_per_s"]]
    drafted, rounds = (sum(s.get(k) or 0 for s in stats) for k in ("drafted", "rounds"))
    entry["tokens_per_s"] = round(statistics.median(rates), 3) if rates else None
    if drafted and SYSTEMS[name].speculative:
        entry["acceptance_rate"] = round(sum(s.get("accepted") or 0 for s in stats) / drafted, 4)
    entry["tokens_per_round"] = round(sum(p["new_tokens"] for p in rows) / rounds, 3) if rounds else None
    return entry


def run_pass(ctx: BenchContext, names: list[str], repeats: int, say: Callable[[str], None]) -> list[dict]:
    """Set up and warm up each system (untimed), run them interleaved, close them: their bench.json entries."""
    baseline, live = proc_state(), {}
    entries = {n: _entry(n, "skipped", why) for n in names if (why := SYSTEMS[n].unavailable(ctx))}
    for reason in dict.fromkeys(e["reason"] for e in entries.values()):
        say(f"skipping {', '.join(n for n, e in entries.items() if e['reason'] == reason)}: {reason}")
    todo = [n for n in names if n not in entries]
    try:
        for index, name in enumerate(todo, 1):
            say(f"setting up {name} ({index}/{len(todo)})")
            system, started = SYSTEMS[name](), time.perf_counter()
            proc_state(baseline)
            try:
                system.setup(ctx)
                system.run(ctx.prompts[0], min(WARMUP_TOKENS, ctx.max_new))
            except Exception as exc:  # any system's failure is reported, the others still run
                with contextlib.suppress(Exception):
                    system.close()
                if name == REFERENCE:
                    raise BenchError(f"the target_only reference failed: {type(exc).__name__}: {exc}") from exc
                entries[name] = _entry(name, "unavailable", f"{type(exc).__name__}: {exc}")
                continue
            live[name] = (system, proc_state(), round(time.perf_counter() - started, 3))

        def run(name: str, prompt: list[int]) -> RunOutput:
            system, state, setup_s = live[name]
            proc_state(state)
            out = system.run(prompt, ctx.max_new)
            live[name] = (system, proc_state(), setup_s)  # a placement that moved re-pinned: its next run keeps that
            return out

        runs, failed = interleave(live, ctx.prompts, repeats, run, must=(REFERENCE,), say=say, settle=quiesce)
        for name, (system, state, setup_s) in live.items():
            extra = {"setup_s": setup_s, "cpus": sorted(state[0] or []), **system.describe(ctx),
                     **({"calibration_s": system.calibration} if system.calibration else {})}
            entries[name] = _entry(name, "failed", failed[name], extra) if name in failed else \
                _measured(name, runs[name], extra, ctx.config.target.precision in ("int8", "int4"))
    finally:
        for system, _, _ in live.values():
            with contextlib.suppress(Exception):  # closing must never hide the results
                system.close()
        proc_state(baseline)
    return [entries[n] for n in names]


def with_references(entries: list[dict], sampled: bool) -> None:
    """speedup_vs_REF, identical_to_REF (prompts) for target_only, a peer's own, (sampled) hetero_spec_target_only."""
    measured = {e["name"]: e for e in entries if e["status"] == "ok"}
    for row in entries:
        cls = SYSTEMS[row["name"]]
        refs = (cls.peer_reference, SAMPLED_REFERENCE if sampled and cls.ours and cls.speculative else None)
        for ref in [REFERENCE, *(r for r in refs if r and r != row["name"])]:
            paired = row["status"] == "ok" and ref in measured and pair(row["per_prompt"], measured[ref]["per_prompt"])
            row[f"speedup_vs_{ref}"], row[f"identical_to_{ref}"] = \
                (paired["median"], paired["identical"]) if paired else (None, None)


def comparisons(entries: list[dict]) -> list[dict[str, Any]]:
    """Ours against the peers, paired per prompt: each of our speculative systems against the best peer (fastest by
    median tokens/s), our first against every speculative peer, target_only against every peer's target alone."""
    measured = {e["name"]: e for e in entries if e["status"] == "ok" and e["tokens_per_s"]}
    ours = [n for n in measured if SYSTEMS[n].ours and SYSTEMS[n].speculative]
    peers = [n for n in measured if not SYSTEMS[n].ours]
    best = max(peers, key=lambda n: measured[n]["tokens_per_s"], default=None)
    todo = [(n, best, "best peer") for n in ours if best]
    todo += [((ours or [None])[0] if SYSTEMS[p].speculative else REFERENCE, p, "") for p in peers]
    out: dict[tuple, dict] = {}
    for name, peer, note in todo:
        if name in measured and (name, peer) not in out and \
                (cmp := pair(measured[name]["per_prompt"], measured[peer]["per_prompt"])):
            out[(name, peer)] = {"system": name, "peer": peer, "note": note, **cmp}
    return list(out.values())


def _prompts(settings: BenchSettings, config: Config, given: list[list[int]] | None) -> tuple[list[list[int]], dict]:
    """(the prompts, where they came from); a BenchError where one is empty or they leave no room in the target's
    context for max_new tokens."""
    from . import prompts
    if given is not None:
        ids, source = given[:settings.n_prompts], {"kind": "given", "available": len(given)}
    elif settings.humaneval:
        ids, source = prompts.humaneval_prompt_ids(config, settings.prompts), {"kind": "humaneval"}
    elif settings.mtbench:
        from ..engine import Engine
        with Engine.from_config(config, overrides={**ALONE, "runtime.cpus": None}) as target:  # first turns' answers
            ids, labels = prompts.mtbench_prompt_ids(config, settings.prompts, lambda first: target.generate(
                first, max_new_tokens=settings.max_new, temperature=0.0).text)
        source = {"kind": "mt-bench", "questions": len(ids) // 2, "labels": labels}
    elif (path := settings.prompts_file) is not None:
        every = prompts.prompts_from_file(path, config)
        ids, source = every[:settings.prompts or None], {"kind": "file", "path": str(path), "available": len(every)}
    else:
        ids = prompts.heldout_prompt_ids(config, settings.config, settings.n_prompts, settings.prompt_tokens)
        source = {"kind": "held-out", "prompt_tokens": settings.prompt_tokens}
    if not ids or any(not p for p in ids):
        raise BenchError("no prompts to benchmark (or an empty prompt)")
    raw = json.loads((Path(config.target.model) / "config.json").read_text())  # the target's context:
    sizes = [x for x in (raw.get("max_position_embeddings") or raw.get("n_positions"), config.target.max_context) if x]
    if sizes and (longest := max(map(len, ids))) + settings.max_new > (context := min(sizes)):
        raise BenchError(f"prompts of {longest} tokens + {settings.max_new} new tokens exceed the target's context of "
                         f"{context}: lower --prompt-tokens or --max-new-tokens")
    return [list(p) for p in ids], source


def run_bench(settings: BenchSettings, prompt_ids: list[list[int]] | None = None) -> dict[str, Any]:
    """Run each pass (of the precision matrix, or one), write OUT/bench.json and OUT/bench.md, return the former.
    prompt_ids replaces the held-out prompts (tests)."""
    from transformers.utils import logging as hf_logging
    from ..gguf_source import resolve as resolve_gguf
    from ..precision import resolve_draft
    from .memory import child_peaks, memory_report
    names, sampling = resolve_systems(settings.systems, settings.temperature), settings.sampling
    base = {**settings.overrides, **({"speculation.sampling": sampling} if sampling else {}), **CPU_FP32}
    given = load_config(settings.config, overrides=base)  # the models as named: a .gguf is also what llama.cpp runs
    check_paths(given)
    passes = [{"target.precision": t} for t in settings.precision_matrix or ()] or [{}]  # each pass's overrides
    configs = [resolve_draft(resolve_gguf(load_config(settings.config, overrides={**base, **p}))) for p in passes]
    prompts, source = _prompts(settings, configs[0], prompt_ids)
    is_hf = given.draft.kind == "onnx" and given.draft.model and (Path(given.draft.model) / "config.json").is_file()
    found = replace(settings, draft_hf=settings.draft_hf or (given.draft.model if is_hf else None),
                    llama_cpp_target=settings.llama_cpp_target or gguf_of(given.target.model),
                    llama_cpp_draft=settings.llama_cpp_draft or gguf_of(given.draft.model))
    done = []
    # peaks: the draft worker's and llama.cpp's peak memory, while they run
    with contextlib.ExitStack() as restore, child_peaks() as peaks:
        restore.callback(hf_logging.set_verbosity, hf_logging.get_verbosity())
        hf_logging.set_verbosity_error()  # generate() warns per call about generation_config defaults
        for over, config in zip(passes, configs):
            if over:
                say("pass: " + ", ".join(f"{k} {v}" for k, v in over.items()))
            entries = run_pass(BenchContext(found, config, prompts), names, settings.repeats, say)
            with_references(entries, settings.temperature > 0)
            done.append({"precision": over, "systems": entries, "comparisons": comparisons(entries)})
    ran_ref = any(e["name"] == REFERENCE and e["status"] == "ok" for p in done for e in p["systems"])
    report: dict[str, Any] = {
        "machine": machine(), "config": {"source": given.source, **given.model_dump(mode="json")},
        "settings": {"command": command_line(settings), "prompts": len(prompts), "prompts_source": source,
                     "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": settings.max_new,
                     "repeats": settings.repeats, "gamma": given.speculation.gamma,
                     "gammas": list(settings.gammas) if settings.gammas else None,
                     "temperature": settings.temperature, "sampling": given.speculation.sampling, "seed": SEED,
                     "ignore_eos": given.generation.ignore_eos, "overrides": settings.overrides,
                     "reference": REFERENCE if ran_ref else None},
        "memory": memory_report(peaks)}
    report |= {"passes": done} if settings.precision_matrix else {k: done[0][k] for k in ("systems", "comparisons")}
    write_report(Path(settings.out), "bench", report, render_markdown(report))
    return report


def say(text: str) -> None:
    print(f"bench: {text}", file=sys.stderr, flush=True)


def command_line(settings: BenchSettings) -> str:
    """The `hetero-spec bench` command that repeats this run."""
    count, gammas = settings.prompts, settings.gammas
    suite = "humaneval" if settings.humaneval else "mt-bench" if settings.mtbench else None
    prompts = (suite + (f":{count}" if count else "")) if suite else str(settings.n_prompts)
    config = ["--config", str(settings.config)] if settings.config else []  # else --set target.model names it
    parts = ["hetero-spec", "bench", *config, "--out", str(settings.out), "--prompts", prompts,
             "--max-new-tokens", str(settings.max_new), "--gammas", ",".join(map(str, gammas)) if gammas else "config"]
    skip = {"config", "out", "prompts", "max_new_tokens", "gammas", "humaneval", "mtbench", "quick", "overrides"}
    for option in fields(settings):
        if option.name not in skip and (value := getattr(settings, option.name)) not in (None, option.default, [], ()):
            parts += ["--" + option.name.replace("_", "-"),
                      ",".join(value) if isinstance(value, (list, tuple)) else str(value)]
    parts += [a for k, v in settings.overrides.items()
              for a in ("--set", f"{k}={v if isinstance(v, str) else json.dumps(v)}")]
    return shlex.join(parts + ["--quick"] * settings.quick)


def machine() -> dict[str, Any]:  # the platform, the CPU and the versions that matter
    from importlib.metadata import distributions
    have = {(d.metadata["Name"] or "").lower(): d.version for d in distributions()}
    return {"platform": platform.platform(), "cpu_count": os.cpu_count(), "cpu_model": _cpu_model() or None,
            "versions": {"python": platform.python_version(), **{p: have.get(p) for p in (
                "torch", "transformers", "onnxruntime", "onnxruntime-genai", "hetero-spec")}}}


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:  # Markdown lines
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header)] + [f"| {' | '.join(map(str, r))} |" for r in rows]


def write_report(out: Path, stem: str, report: dict[str, Any], markdown: str) -> None:  # OUT/STEM.json, .md
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)


def fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _system_row(entry: dict[str, Any]) -> list[str]:
    """A system's row of a pass's table (against target_only; other references in its notes)."""
    extra, n_prompts = entry["extra"], len(entry["per_prompt"])
    notes = [f"{entry['status']}: {entry['reason']}"] * (entry["status"] != "ok") + [
        f"{fmt(entry[f'speedup_vs_{k[13:]}'], '.2f')}x {k[13:]}, identical on {v} of {n_prompts} prompts"
        for k, v in entry.items() if k.startswith("identical_to_") and k[13:] != REFERENCE and v is not None]
    if changed := extra.get("changed_between_repeats"):
        notes.append(f"output changed between repeats on {changed} prompt(s) (int8/int4)")
    threads = fmt(extra.get("target_threads"), "") + (f" + {draft}" if (draft := extra.get("draft_threads")) else "")
    identical = entry.get("identical_to_target_only")
    return [entry["name"], extra.get("backend", "-"), extra.get("layout", "-"), threads, fmt(extra.get("gamma"), ""),
            fmt(entry["tokens_per_s"], ".1f"), fmt(entry.get("speedup_vs_target_only"), ".2f") + "x",
            fmt(entry["acceptance_rate"]), "-" if identical is None else f"{identical}/{n_prompts}", "; ".join(notes)]


def _by_label(bench_pass: dict[str, Any], labels: list[str]) -> list[str]:
    """Prompts with labels ("category/turn", MT-Bench): each system's speedup over target_only per category, the
    median over the category's prompts (both turns), paired as in the comparisons."""
    ran = {e["name"]: e["per_prompt"] for e in bench_pass["systems"] if e["status"] == "ok"}
    if REFERENCE not in ran or len(ran) < 2:
        return []
    names, categories = [n for n in ran if n != REFERENCE], list(dict.fromkeys(x.split("/")[0] for x in labels))
    rows = []
    for category in categories:
        picked = [i for i, x in enumerate(labels) if x.split("/")[0] == category]
        cells = [pair([ran[n][i] for i in picked], [ran[REFERENCE][i] for i in picked]) for n in names]
        rows.append([category, str(len(picked)), *(f"{c['median']:.2f}x" if c else "-" for c in cells)])
    return ["", "Speedup over target_only by category (median over its prompts, both turns):", "",
            *table(["category", "prompts", *names], rows)]


def _pass_markdown(bench_pass: dict[str, Any], labels: list[str] | None = None) -> list[str]:
    """One pass: the systems, skipped ones, comparisons, and per category where the prompts have labels."""
    skipped = [e for e in bench_pass["systems"] if e["status"] == "skipped"]
    lines = table(["system", "backend", "layout", "threads", "gamma", "tok/s", "speedup vs target_only",
                   "acceptance", "identical to target_only", "notes"],
                  [_system_row(e) for e in bench_pass["systems"] if e["status"] != "skipped"])
    if not any(e["name"] == REFERENCE and e["status"] == "ok" for e in bench_pass["systems"]):
        lines += ["", "No reference: target_only did not run, so there are no speedups; add it to --systems."]
    lines += [""] * bool(skipped)
    for reason in dict.fromkeys(e["reason"] for e in skipped):
        lines.append(f"- skipped {', '.join(e['name'] for e in skipped if e['reason'] == reason)}: {reason}")
    if bench_pass["comparisons"]:
        lines += ["", "Paired per prompt (the peer's time / ours, median over prompts):", "", *table(
            ["ours", "peer", "median", "range", "faster on", "identical outputs"],
            [[c["system"], c["peer"] + (f" ({c['note']})" if c["note"] else ""), f"{c['median']:.2f}x",
              f"{c['min']:.2f}-{c['max']:.2f}", f"{c['won']}/{c['prompts']}", f"{c['identical']}/{c['prompts']}"]
             for c in bench_pass["comparisons"]])]
    return lines + (_by_label(bench_pass, labels) if labels else [])


def render_markdown(report: dict[str, Any]) -> str:
    settings, cpu, source = report["settings"], report["machine"], report["settings"]["prompts_source"]
    count = settings["prompts"]
    first = f", the first {count} of {source['available']}" if source.get("available") not in (None, count) else ""
    where = f" ({source['kind']}{' ' + source['path'] if 'path' in source else ''}{first})"
    decoding = "greedy" if not settings["temperature"] else \
        "our systems sampled at temperature {temperature} ({sampling}, seed {seed}), peers greedy".format_map(settings)
    gamma = "gamma calibrated per system over {gammas}" if settings["gammas"] else "gamma {gamma}"
    lines = ["# hetero-spec bench", "", f"`{settings['command']}`", "",
             f"{count} prompt{'s' * (count != 1)}{where} x {settings['max_new_tokens']} new tokens"
             f"{' (EOS ignored)' * bool(settings.get('ignore_eos'))}, {decoding}, {gamma.format_map(settings)}, "
             f"{cpu['cpu_count']} CPUs ({cpu['cpu_model']}); interleaved per prompt, the order rotating, after one "
             f"untimed warm-up per system (one that tunes itself: the first two prompts), each run after the cores "
             f"settle; a prompt's time is the median of {settings['repeats']} run(s).", ""]
    for bench_pass in report.get("passes") or [report]:
        if bench_pass.get("precision"):
            lines += ["", "## " + ", ".join(f"{k} {v}" for k, v in bench_pass["precision"].items()), ""]
        lines += _pass_markdown(bench_pass, source.get("labels"))
    kids = ", ".join(f"{k} {v:,.0f} MB" for k, v in report["memory"]["children"].items()) or "none"
    return "\n".join(lines + ["", f"Peak memory (RSS high-water mark): bench process "
                                  f"{report['memory']['peak_rss_mb']:,.0f} MB (every system in it, loaded together); "
                                  f"child processes, each its own peak: {kids}."]) + "\n"


def gguf_of(model: Path | None) -> Path | None:
    """The GGUF a model is: a .gguf file, or a directory's only .gguf."""
    if model is None or not (model := Path(model)).exists():
        return None
    found = [model] if model.suffix == ".gguf" else sorted(model.glob("*.gguf")) if model.is_dir() else []
    return found[0] if len(found) == 1 else None
