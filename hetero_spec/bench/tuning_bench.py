"""`hetero-spec bench --scenario`: benchmarks of the engine's self-tuning (issue 10), not timed tests.

Scenarios, each on the config's model pair through the public `Engine` API:

- gamma-sweep: fixed gamma 1..16 against `speculation.gamma: auto`, per layout (in_process, two_process).
  The best of 16 noisy fixed gammas is biased upward (the winner's curse), so a confirmation pass runs
  auto against the sweep's best gamma and its neighbours only, with more repeats; the 5 % verdict comes
  from that pass.
- repetitive: prompts whose later lines repeat earlier ones (a block of held-out code lines, then its
  first lines again), decoded with the model draft alone, n-gram lookup alone, and per-round selection
  between the two (`draft.candidates: [onnx, ngram]`). Selection should beat both.
- useless-draft: an untrained, randomly initialised draft (the demo draft's config and tokenizer, built and
  exported once into the cache) with `gamma: auto`, against the target alone. Auto (and the cost gate in
  two_process) should keep the loss within 3 % of target-only throughput.

Machine noise: the result is always a ratio from one side-by-side pass. Within a pass the arms run
interleaved per prompt, the order rotating from prompt to prompt and repeat to repeat; a prompt's time is
the median of its repeats; arms are paired per prompt with target-only (throughput ratio, the median of the
per-prompt ratios, and on how many prompts the arm won). Every arm decodes greedily and its token ids are
compared with target-only's ("identical 12/12"): a speedup from different output would be no speedup.

Outputs: OUT/tuning.json (settings, per scenario the passes with raw per-prompt times), OUT/tuning.md, and
one PNG per scenario.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .context import CPU_FP32, BenchError, RunOutput

SCENARIOS = ("gamma-sweep", "repetitive", "useless-draft")
LAYOUTS = ("in_process", "two_process")
DEFAULT_LAYOUTS = {"gamma-sweep": LAYOUTS, "repetitive": ("in_process",), "useless-draft": LAYOUTS}
SWEEP_GAMMAS = tuple(range(1, 17))
QUICK_SWEEP_GAMMAS = (1, 2, 3, 4, 6, 8, 12, 16)
WARMUP_PROMPTS = 2  # held-out prompts beyond the timed ones, decoded untimed by every engine first
AUTO_TOLERANCE = 0.95  # gamma auto must reach 95 % of the best fixed gamma's throughput
USELESS_TOLERANCE = 0.97  # a useless draft may cost at most 3 % of target-only throughput
TARGET_ONLY = "target_only"

Say = Callable[[str], None]


def say_stderr(text: str) -> None:
    print(f"bench: {text}", file=sys.stderr, flush=True)


# -- settings --------------------------------------------------------------------------------------
def parse_scenarios(values: Sequence[str]) -> list[str]:
    """`--scenario a --scenario b,c` -> [a, b, c] in the order given, each once; a clear error otherwise."""
    out: list[str] = []
    for value in values:
        for name in (v.strip() for v in value.split(",")):
            if not name:
                continue
            if name not in SCENARIOS:
                raise BenchError(f"--scenario {name!r}: unknown scenario; choose from {', '.join(SCENARIOS)}")
            if name not in out:
                out.append(name)
    if not out:
        raise BenchError(f"--scenario: no scenario given; choose from {', '.join(SCENARIOS)}")
    return out


def parse_layouts(value: str | None) -> tuple[str, ...] | None:
    """`--layouts in_process,two_process` -> a tuple; None keeps each scenario's default layouts."""
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in LAYOUTS]
    if bad or not names:
        raise BenchError(f"--layouts {value!r}: each must be one of {', '.join(LAYOUTS)}")
    return tuple(dict.fromkeys(names))


def parse_gammas(value: str | None, quick: bool) -> tuple[int, ...]:
    """The fixed gammas of the sweep: --gammas, else 1..16 (a subset with --quick)."""
    if value is None:
        return QUICK_SWEEP_GAMMAS if quick else SWEEP_GAMMAS
    try:
        gammas = tuple(sorted({int(g) for g in value.split(",") if g.strip()}))
    except ValueError:
        raise BenchError(f"--gammas must be comma-separated integers, got {value!r}") from None
    if not gammas or any(not 1 <= g <= 64 for g in gammas):
        raise BenchError(f"--gammas: each draft length must be in 1..64, got {value!r}")
    return gammas


@dataclass
class ScenarioSettings:
    """What to run. None means the scenario's default (see the module docstring and `hetero-spec bench -h`)."""

    config: Path
    out: Path
    scenarios: list[str]
    prompts: int | None = None
    max_new_tokens: int | None = None
    repeats: int | None = None
    quick: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 128
    prompts_file: Path | None = None
    gammas: tuple[int, ...] = SWEEP_GAMMAS
    layouts: tuple[str, ...] | None = None
    draft_hf: Path | None = None

    @property
    def n_prompts(self) -> int:
        return self.prompts or (4 if self.quick else 12)

    @property
    def max_new(self) -> int:
        return self.max_new_tokens or (64 if self.quick else 128)

    def layouts_for(self, scenario: str) -> tuple[str, ...]:
        return self.layouts or DEFAULT_LAYOUTS[scenario]


# -- measurement: interleaving, medians, pairing (pure; tests drive it with a fake runner and clock) ------
@dataclass(frozen=True)
class Arm:
    """One measured configuration: an engine (by name) and the gamma passed per request (None: the config's)."""

    name: str
    engine: str
    gamma: int | str | None = None


class Runner(Protocol):
    """Runs arms on prompts. `unavailable` names the engines that could not start, and why."""

    unavailable: dict[str, str]

    def prepare(self, arm: Arm) -> None: ...

    def run(self, arm: Arm, prompt: list[int]) -> RunOutput: ...


@dataclass
class Sample:
    """One arm on one prompt: its output, and its time (the median of the repeats)."""

    token_ids: list[int]
    wall_s: float
    repeats_s: list[float]
    stats: dict[str, Any] | None = None
    stable: bool = True  # the same output in every repeat


@dataclass
class PassResult:
    samples: dict[str, list[Sample]]
    failed: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0


def rotation(arms: Sequence[Arm], prompt_index: int, repeat: int, repeats: int) -> list[Arm]:
    """The run order of one repeat on one prompt: rotated so that no arm always follows the same one."""
    shift = (prompt_index * repeats + repeat) % len(arms)
    return list(arms[shift:]) + list(arms[:shift])


def interleave(arms: Sequence[Arm], prompts: Sequence[list[int]], repeats: int, runner: Runner,
               clock: Callable[[], float] = time.perf_counter, say: Say | None = None,
               label: str = "pass") -> PassResult:
    """Run every arm on every prompt `repeats` times, interleaved (see rotation). An arm that raises is
    reported as failed and left out of the rest of the pass; the others go on."""
    live = list(arms)
    samples: dict[str, list[Sample]] = {a.name: [] for a in arms}
    failed: dict[str, str] = {}
    start = clock()
    for i, prompt in enumerate(prompts):
        walls: dict[str, list[float]] = {a.name: [] for a in live}
        outs: dict[str, list[RunOutput]] = {a.name: [] for a in live}
        for r in range(repeats):
            for arm in rotation(live, i, r, repeats):
                if arm.name in failed:
                    continue
                try:
                    runner.prepare(arm)
                    t = clock()
                    out = runner.run(arm, prompt)
                    walls[arm.name].append(clock() - t)
                except Exception as exc:  # one arm's failure is reported; the pass goes on
                    failed[arm.name] = f"prompt {i}: {type(exc).__name__}: {exc}"
                    continue
                outs[arm.name].append(out)
        live = [a for a in live if a.name not in failed]
        for arm in live:
            runs = outs[arm.name]
            samples[arm.name].append(Sample(
                token_ids=list(runs[0].token_ids), wall_s=statistics.median(walls[arm.name]),
                repeats_s=walls[arm.name], stats=runs[0].stats,
                stable=all(o.token_ids == runs[0].token_ids for o in runs)))
        if say is not None:
            say(f"{label}: prompt {i + 1}/{len(prompts)} done ({clock() - start:.0f} s)")
    for name in failed:
        samples.pop(name, None)
    return PassResult(samples=samples, failed=failed, wall_s=clock() - start)


def throughput_ratio(ours: Sample, ref: Sample) -> float:
    """Our tokens/s over the reference's on the same prompt (> 1: we are faster). With the same number of
    tokens (always, when the outputs are identical) this is the reference's time over ours."""
    n, m = len(ours.token_ids), len(ref.token_ids)
    if n == m or not n or not m:
        return ref.wall_s / ours.wall_s
    return (n / ours.wall_s) / (m / ref.wall_s)


def pair(ours: Sequence[Sample], ref: Sequence[Sample]) -> dict[str, Any]:
    """Per-prompt pairing of an arm with a reference from the same pass: the median of the per-prompt
    throughput ratios, their range, on how many prompts the arm was faster, and output identity."""
    if len(ours) != len(ref) or not ours:
        raise ValueError(f"pairing needs the same prompts on both sides, got {len(ours)} and {len(ref)}")
    ratios = [throughput_ratio(a, b) for a, b in zip(ours, ref)]
    return {"median": round(statistics.median(ratios), 4), "min": round(min(ratios), 4),
            "max": round(max(ratios), 4), "won": sum(r > 1.0 for r in ratios), "prompts": len(ratios),
            "identical": sum(a.token_ids == b.token_ids for a, b in zip(ours, ref)),
            "ratios": [round(r, 4) for r in ratios]}


def acceptance(samples: Sequence[Sample]) -> float | None:
    """Accepted over drafted tokens, all prompts together (None: nothing drafted, or no stats)."""
    stats = [s.stats for s in samples if s.stats]
    drafted = sum(st.get("drafted", 0) for st in stats)
    return round(sum(st.get("accepted", 0) for st in stats) / drafted, 4) if drafted else None


def auto_choices(samples: Sequence[Sample]) -> dict[str, int]:
    """How often gamma auto picked each gamma (rounds in process, requests in two_process), all prompts."""
    total: Counter = Counter()
    for s in samples:
        total.update(((s.stats or {}).get("extra") or {}).get("gamma_auto", {}).get("choices", {}))
    return {k: total[k] for k in sorted(total, key=int)}


STAGES = ("prefill", "draft", "verify", "wait", "idle")


def stage_ms(samples: Sequence[Sample]) -> dict[str, float] | None:
    """Where a request's time went, in ms: the median over prompts of each stage (stats.time_<stage>_s)."""
    stats = [s.stats for s in samples if s.stats]
    if len(stats) != len(samples) or not stats:
        return None
    return {k: round(statistics.median(st.get(f"time_{k}_s", 0.0) for st in stats) * 1e3, 2) for k in STAGES}


def summarize_pass(result: PassResult, arms: Sequence[Arm], ref: str = TARGET_ONLY) -> dict[str, Any]:
    """Each arm of a pass against the reference arm: pairing, acceptance, stability, and raw times."""
    base = result.samples.get(ref)
    out: dict[str, Any] = {}
    for arm in arms:
        if arm.name in result.failed or arm.name not in result.samples:
            out[arm.name] = {"status": "failed", "reason": result.failed.get(arm.name, "did not run")}
            continue
        s = result.samples[arm.name]
        entry: dict[str, Any] = {"status": "ok", "engine": arm.engine, "gamma": arm.gamma,
                                 "vs_target_only": pair(s, base) if base else None,
                                 "acceptance": acceptance(s), "stable_prompts": sum(x.stable for x in s),
                                 "stage_ms": stage_ms(s),
                                 "wall_s": [round(x.wall_s, 6) for x in s],
                                 "repeats_s": [[round(t, 6) for t in x.repeats_s] for x in s]}
        if choices := auto_choices(s):
            entry["gamma_auto_choices"] = choices
        extra = (s[-1].stats or {}).get("extra") or {}
        for key in ("draft_selection", "gate"):
            if extra.get(key) is not None:
                entry[f"{key}_last_prompt"] = extra[key]
        out[arm.name] = entry
    return out


def median_vs_ref(summary: dict[str, Any], name: str) -> float | None:
    e = summary.get(name) or {}
    return (e.get("vs_target_only") or {}).get("median") if e.get("status") == "ok" else None


# -- engines --------------------------------------------------------------------------------------
def target_only_overrides() -> dict[str, Any]:
    """The engine without a draft, in process, with the config's backend and target threads."""
    return {"draft.kind": "none", "draft.candidates": [], "runtime.mode": "in_process"}


class EngineRunner:
    """The engines of one pass, started once, each from the same process state, and warmed up untimed on
    the warm-up prompts (full length: gamma auto and draft selection learn from them). A two-process
    engine changes affinity and threads of this process; each arm runs in the state its engine set up."""

    def __init__(self, config: Path, base: dict[str, Any], engines: dict[str, dict[str, Any]],
                 warmup: Sequence[list[int]], max_new: int, say: Say):
        from .run import ProcState

        self.max_new = max_new
        self.unavailable: dict[str, str] = {}
        self._engines: dict[str, tuple[Any, Any]] = {}
        baseline = ProcState.capture()
        try:
            for i, (name, overrides) in enumerate(engines.items(), 1):
                say(f"starting engine {name} ({i}/{len(engines)}), warm-up on {len(warmup)} untimed prompt(s)")
                baseline.apply()
                self._start(name, config, {**base, **overrides}, warmup)
                if name in self._engines:
                    self._engines[name] = (self._engines[name][0], ProcState.capture())
                elif name in self.unavailable:
                    say(f"engine {name} unavailable: {self.unavailable[name]}")
        except BaseException:
            self.close()
            raise
        finally:
            baseline.apply()
        self._baseline = baseline

    def _start(self, name: str, config: Path, overrides: dict[str, Any], warmup: Sequence[list[int]]) -> None:
        from ..engine import Engine

        try:
            engine = Engine.from_config(config, overrides=overrides)
        except Exception as exc:  # e.g. a ConfigError: this layout does not support the arm
            self.unavailable[name] = f"{type(exc).__name__}: {exc}"
            return
        self._engines[name] = (engine, None)
        try:
            for p in warmup or []:
                engine.generate(p, max_new_tokens=self.max_new, temperature=0.0, seed=0)
        except Exception as exc:
            self.unavailable[name] = f"warm-up failed: {type(exc).__name__}: {exc}"
            self._engines.pop(name)
            engine.close()

    def prepare(self, arm: Arm) -> None:
        self._engines[arm.engine][1].apply()

    def run(self, arm: Arm, prompt: list[int]) -> RunOutput:
        if arm.engine not in self._engines:
            raise BenchError(f"engine {arm.engine} is not running: {self.unavailable.get(arm.engine)}")
        out = self._engines[arm.engine][0].generate(prompt, max_new_tokens=self.max_new, temperature=0.0,
                                                    seed=0, gamma=arm.gamma)
        return RunOutput(out.token_ids, out.stats)

    def describe(self, name: str) -> dict[str, Any] | None:
        """The resolved settings that matter for the comparison (shown in tuning.json)."""
        if name not in self._engines:
            return None
        c = self._engines[name][0].config
        return {"backend": c.target.backend, "layout": c.runtime.mode, "draft": c.draft.kind,
                "draft_model": str(c.draft.model) if c.draft.kind == "onnx" else None,
                "candidates": list(c.draft.candidates), "gamma": c.speculation.gamma,
                "target_threads": c.target.threads, "draft_threads": c.draft.threads}

    def close(self) -> None:
        for engine, _ in self._engines.values():
            try:
                engine.close()
            except Exception as exc:  # closing must never hide the results
                say_stderr(f"closing an engine: {exc}")
        self._engines.clear()
        if getattr(self, "_baseline", None) is not None:
            self._baseline.apply()

    def __enter__(self) -> EngineRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


MakeRunner = Callable[[dict[str, dict[str, Any]], Sequence[list[int]]], Any]


@dataclass
class Scenario:
    """What every scenario shares: prompts, lengths, repeats, how to start engines, the clock."""

    settings: ScenarioSettings
    make_runner: MakeRunner
    heldout: PromptSet | None = None
    """Held-out prompts (gamma-sweep, useless-draft)."""
    repetitive: PromptSet | None = None
    """Prompts whose later lines repeat earlier ones (repetitive)."""
    useless_draft: Callable[[], Path] | None = None
    """Builds (once) or finds the useless draft; returns its ONNX directory."""
    clock: Callable[[], float] = time.perf_counter
    say: Say = say_stderr

    def repeats(self, default: int) -> int:
        return self.settings.repeats or default

    def run_pass(self, label: str, engines: dict[str, dict[str, Any]], arms: list[Arm], repeats: int,
                 prompts: PromptSet) -> tuple[dict[str, Any], PassResult]:
        """Start the engines (warm-up included), run the arms interleaved, close the engines.
        Returns the pass's summary (arms against target-only) and its raw samples."""
        with self.make_runner(engines, prompts.warmup) as runner:
            gone = {a.name: f"engine unavailable: {runner.unavailable[a.engine]}" for a in arms
                    if a.engine in runner.unavailable}
            live = [a for a in arms if a.name not in gone]
            if not any(a.name == TARGET_ONLY for a in live):
                raise BenchError(f"{label}: the target-only reference did not start: {gone.get(TARGET_ONLY)}")
            self.say(f"{label}: {len(live)} arms x {len(prompts.prompts)} prompts x {repeats} repeat(s), "
                     "interleaved")
            result = interleave(live, prompts.prompts, repeats, runner, clock=self.clock, say=self.say, label=label)
            described = {n: d for n in engines if (d := _describe(runner, n)) is not None}
        result.failed.update(gone)
        arms_summary = summarize_pass(result, arms)
        return {"arms": arms_summary, "repeats": repeats, "prompts": len(prompts.prompts),
                "wall_s": round(result.wall_s, 1), "engines": described,
                "identical": {n: f"{e['vs_target_only']['identical']}/{e['vs_target_only']['prompts']}"
                              for n, e in arms_summary.items() if e["status"] == "ok"}}, result


@dataclass
class PromptSet:
    """Timed prompts and the untimed warm-up prompts every engine decodes first; note says where from."""

    prompts: list[list[int]]
    warmup: list[list[int]]
    note: str = ""


def _describe(runner: Any, name: str) -> dict[str, Any] | None:
    return runner.describe(name) if hasattr(runner, "describe") else None


def pair_arms(result: PassResult, name: str, ref: str) -> dict[str, Any] | None:
    """name's throughput over ref's, per prompt, in one pass (None when either did not complete)."""
    if name not in result.samples or ref not in result.samples:
        return None
    return pair(result.samples[name], result.samples[ref])


# -- scenario 1: gamma sweep ------------------------------------------------------------------------
def fixed_arm(g: int) -> Arm:
    return Arm(f"gamma={g}", "fixed", g)


def best_and_neighbours(summary: dict[str, Any], gammas: Sequence[int]) -> tuple[int, list[int]]:
    """The fixed gamma with the highest median speedup over target-only in the sweep, and the swept
    gammas either side of it (the confirmation pass measures all three again)."""
    done = [(g, m) for g in sorted(gammas) if (m := median_vs_ref(summary, fixed_arm(g).name)) is not None]
    if not done:
        raise BenchError("gamma sweep: no fixed gamma completed the sweep")
    i = max(range(len(done)), key=lambda j: done[j][1])
    return done[i][0], [g for g, _ in done[max(0, i - 1):i] + done[i + 1:i + 2]]


def auto_verdict(result: PassResult, summary: dict[str, Any], candidates: Sequence[int]) -> dict[str, Any]:
    """From the confirmation pass: its best fixed gamma (highest median speedup over target-only) and auto's
    throughput over that gamma's, paired per prompt; auto passes at AUTO_TOLERANCE or above."""
    scored = [(m, g) for g in candidates if (m := median_vs_ref(summary, fixed_arm(g).name)) is not None]
    if not scored or median_vs_ref(summary, "auto") is None:
        return {"available": False, "reason": "auto or every fixed gamma failed in the confirmation pass"}
    best = max(scored)[1]
    vs_best = pair_arms(result, "auto", fixed_arm(best).name)
    return {"available": True, "best_fixed_gamma": best, "auto_vs_best": vs_best,
            "auto_vs_each": {fixed_arm(g).name: pair_arms(result, "auto", fixed_arm(g).name)
                             for g in sorted(g for _, g in scored)},
            "within_tolerance": vs_best["median"] >= AUTO_TOLERANCE, "tolerance": AUTO_TOLERANCE}


def sweep_engines(layout: str) -> dict[str, dict[str, Any]]:
    """Target-only; one engine for every fixed gamma (gamma per request); auto's own engine, so that what
    auto learns online comes from its own requests only."""
    return {TARGET_ONLY: target_only_overrides(),
            "fixed": {"runtime.mode": layout, "draft.candidates": []},
            "auto": {"runtime.mode": layout, "draft.candidates": [], "speculation.gamma": "auto"}}


def run_gamma_sweep(sc: Scenario) -> dict[str, Any]:
    out: dict[str, Any] = {"gammas": list(sc.settings.gammas), "prompts_note": sc.heldout.note, "layouts": {}}
    for layout in sc.settings.layouts_for("gamma-sweep"):
        out["layouts"][layout] = sweep_layout(sc, layout)
    return out


def sweep_layout(sc: Scenario, layout: str) -> dict[str, Any]:
    """Sweep every fixed gamma and auto, then confirm auto against the sweep's best and its neighbours.
    Each pass starts its engines afresh (auto re-learns from the same warm-up prompts)."""
    gammas = sc.settings.gammas
    engines = sweep_engines(layout)
    arms = [Arm(TARGET_ONLY, TARGET_ONLY), *(fixed_arm(g) for g in gammas), Arm("auto", "auto")]
    sweep, _ = sc.run_pass(f"gamma-sweep {layout} sweep", engines, arms, sc.repeats(1), sc.heldout)
    best, neighbours = best_and_neighbours(sweep["arms"], gammas)
    cand = sorted([best, *neighbours])
    sc.say(f"gamma-sweep {layout}: best fixed gamma of the sweep: {best}; confirming auto against {cand}")
    c_arms = [Arm(TARGET_ONLY, TARGET_ONLY), *(fixed_arm(g) for g in cand), Arm("auto", "auto")]
    confirm_repeats = max(3, 2 * sc.repeats(1))
    confirm, result = sc.run_pass(f"gamma-sweep {layout} confirm", engines, c_arms, confirm_repeats, sc.heldout)
    return {"sweep": sweep, "sweep_best_gamma": best, "confirm": confirm,
            "verdict": auto_verdict(result, confirm["arms"], cand)}


# -- scenario 2: repetitive text ----------------------------------------------------------------------
def repetitive_text(text: str, min_lines: int = 4, repeat_fraction: float = 0.5) -> str:
    """A text whose continuation is likely a repeat: the complete lines of `text` (its first and last
    lines may be cut mid-line, so they are dropped), then its first lines again, ending on a newline
    where the next line of the block would follow. BenchError when fewer than min_lines non-blank lines."""
    lines = text.split("\n")[1:-1]
    if sum(bool(line.strip()) for line in lines) < min_lines:
        raise BenchError(f"a repetitive prompt needs {min_lines} complete non-blank lines; the text has "
                         f"{sum(bool(line.strip()) for line in lines)}")
    head = lines[:max(1, round(len(lines) * repeat_fraction))]
    return "\n".join(lines + head) + "\n"


def repetitive_prompts(texts: Sequence[str], encode: Callable[[str], list[int]], count: int) -> list[list[int]]:
    """Up to `count` repetitive prompts as token ids, from the texts in order; texts without enough complete
    lines are skipped."""
    built: list[list[int]] = []
    for text in texts:
        if len(built) == count:
            break
        try:
            built.append(encode(repetitive_text(text)))
        except BenchError:
            continue
    return built


def repetitive_engines(layout: str) -> dict[str, dict[str, Any]]:
    """The model draft, n-gram lookup, and per-round selection between them. n-gram lookup has no model
    and no worker: it runs in process whatever the layout."""
    return {TARGET_ONLY: target_only_overrides(),
            "onnx": {"draft.kind": "onnx", "draft.candidates": [], "runtime.mode": layout},
            "ngram": {"draft.kind": "ngram", "draft.candidates": [], "runtime.mode": "in_process"},
            "select": {"draft.kind": "onnx", "draft.candidates": ["onnx", "ngram"], "runtime.mode": layout}}


def run_repetitive(sc: Scenario) -> dict[str, Any]:
    out: dict[str, Any] = {"prompts_note": sc.repetitive.note, "layouts": {}}
    for layout in sc.settings.layouts_for("repetitive"):
        arms = [Arm(TARGET_ONLY, TARGET_ONLY), Arm("onnx", "onnx"), Arm("ngram", "ngram"), Arm("select", "select")]
        summary, result = sc.run_pass(f"repetitive {layout}", repetitive_engines(layout), arms,
                                      sc.repeats(3), sc.repetitive)
        vs = {peer: pair_arms(result, "select", peer) for peer in ("onnx", "ngram")}
        beats = all(v is not None and v["median"] > 1.0 for v in vs.values())
        out["layouts"][layout] = {**summary, "select_vs": vs,
                                  "verdict": {"available": "select" in result.samples,
                                              "select_beats_both": beats if "select" in result.samples else None}}
    return out


# -- scenario 3: a useless draft ----------------------------------------------------------------------
def useless_key(source: Path, precision: str, block_size: int | None, seed: int) -> str:
    """What identifies a useless draft: the source's config and tokenizer, precision, block, seed, builder."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        builder = version("onnxruntime-genai")
    except PackageNotFoundError:
        builder = "?"
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json"):
        h.update((source / name).read_bytes())
    h.update(json.dumps([precision, block_size, seed, builder]).encode())
    return h.hexdigest()[:16]


def build_useless_draft(source: Path, precision: str = "int4", block_size: int | None = 128, seed: int = 0,
                        root: Path | None = None, say: Say = say_stderr) -> Path:
    """An untrained draft: source's config.json and tokenizer, randomly initialised (seed), exported by
    the project's exporter (int4, block 128: like the shipped draft) into the cache as
    useless-draft-KEY/onnx. Built once; later calls reuse it. Returns the ONNX directory."""
    import fcntl

    from ..draft.export import export_draft
    from ..target.export_cache import cache_root

    source = Path(source)
    if not (source / "config.json").is_file() or not (source / "tokenizer.json").is_file():
        raise BenchError(f"--draft-hf {str(source)!r}: a useless draft is built from a Hugging Face "
                         "directory with config.json and tokenizer.json")
    entry = (root or cache_root()) / f"useless-draft-{useless_key(source, precision, block_size, seed)}"
    if (entry / "onnx" / "model.onnx").is_file():
        say(f"useless-draft: reusing {entry / 'onnx'}")
        return entry / "onnx"
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f"{entry.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another bench may be building the same draft
        if (entry / "onnx" / "model.onnx").is_file():
            return entry / "onnx"
        scratch = entry.parent / f"{entry.name}.tmp-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            say(f"useless-draft: building a random {source.name} (seed {seed}) into {entry} once")
            _random_checkpoint(source, scratch / "hf", seed)
            export_draft(scratch / "hf", scratch / "onnx", precision, block_size=block_size,
                         progress=lambda text: say(f"useless-draft: export: {text}"))
            scratch.rename(entry)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return entry / "onnx"


def _random_checkpoint(source: Path, out: Path, seed: int) -> None:
    """source's architecture with fresh random weights (fp32), and its tokenizer files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)


def useless_engines(draft: Path, layouts: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Target-only, the useless draft with gamma auto in each layout, and with the layout itself chosen by
    measurement (runtime.mode and runtime.cpus auto, as configs/cpu-demo.yaml ships: the placement learns
    the draft is useless and moves to the target alone on every core)."""
    eng = {TARGET_ONLY: target_only_overrides()}
    for layout in layouts:
        eng[f"auto {layout}"] = {"draft.kind": "onnx", "draft.model": str(draft), "draft.candidates": [],
                                 "runtime.mode": layout, "speculation.gamma": "auto"}
    eng["auto placement"] = {"draft.kind": "onnx", "draft.model": str(draft), "draft.candidates": [],
                             "runtime.mode": "auto", "runtime.cpus": "auto", "speculation.gamma": "auto"}
    return eng


def run_useless_draft(sc: Scenario) -> dict[str, Any]:
    """One pass: target-only and the useless draft with gamma auto in each layout, side by side."""
    draft = sc.useless_draft()
    layouts = sc.settings.layouts_for("useless-draft")
    engines = useless_engines(draft, layouts)
    arms = [Arm(name, name) for name in engines]
    summary, _ = sc.run_pass("useless-draft", engines, arms, sc.repeats(3), sc.heldout)
    verdict = {}
    for layout in [*layouts, "placement"]:
        m = median_vs_ref(summary["arms"], f"auto {layout}")
        verdict[layout] = {"ratio": m, "within_tolerance": None if m is None else m >= USELESS_TOLERANCE}
    return {"draft": str(draft), "prompts_note": sc.heldout.note, "pass": summary, "verdict": verdict,
            "tolerance": USELESS_TOLERANCE}


RUNNERS = {"gamma-sweep": run_gamma_sweep, "repetitive": run_repetitive, "useless-draft": run_useless_draft}


def run_scenarios(sc: Scenario) -> dict[str, Any]:
    """Run the chosen scenarios in turn; each scenario's entry has its wall time."""
    out: dict[str, Any] = {}
    for name in sc.settings.scenarios:
        t = time.perf_counter()
        sc.say(f"scenario {name}: start")
        out[name] = RUNNERS[name](sc)
        out[name]["scenario_wall_s"] = round(time.perf_counter() - t, 1)
        sc.say(f"scenario {name}: done in {out[name]['scenario_wall_s']:.0f} s")
    return out


# -- report: Markdown and plots ---------------------------------------------------------------------
def _x(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _arm_rows(arms: dict[str, Any]) -> list[str]:
    rows = ["| arm | throughput vs target_only (median) | range | faster on | identical | acceptance | "
            "ms/request: draft / verify / wait / idle | gamma auto chose (count) |",
            "|---|---:|---|---:|---:|---:|---|---|"]
    for name, e in arms.items():
        if e["status"] != "ok":
            rows.append(f"| {name} | - | - | - | - | - | - | {e['status']}: {e['reason']} |")
            continue
        v = e["vs_target_only"]
        choices = ", ".join(f"{g}: {c}" for g, c in (e.get("gamma_auto_choices") or {}).items()) or "-"
        st = e.get("stage_ms")
        stages = " / ".join(f"{st[k]:.0f}" for k in ("draft", "verify", "wait", "idle")) if st else "-"
        unstable = v["prompts"] - e["stable_prompts"]
        ident = f"{v['identical']}/{v['prompts']}" + (f" (changed between repeats on {unstable})" if unstable else "")
        rows.append(f"| {name} | {v['median']:.3f}x | {v['min']:.2f}-{v['max']:.2f} | {v['won']}/{v['prompts']} | "
                    f"{ident} | {_x(e['acceptance'])} | {stages} | {choices} |")
    return rows


def _pass_head(title: str, p: dict[str, Any]) -> list[str]:
    return ["", f"{title} ({p['prompts']} prompts x {p['repeats']} repeat(s), interleaved; pass {p['wall_s']:.0f} s):",
            "", *_arm_rows(p["arms"])]


def _pairing(label: str, v: dict[str, Any] | None) -> str:
    if v is None:
        return f"{label}: not available"
    return (f"{label}: median {v['median']:.3f}x (range {v['min']:.2f}-{v['max']:.2f}, faster on "
            f"{v['won']}/{v['prompts']} prompts, identical outputs {v['identical']}/{v['prompts']})")


def _md_gamma_sweep(r: dict[str, Any]) -> list[str]:
    lines = ["## gamma-sweep", "", f"Fixed gammas {r['gammas']} against `speculation.gamma: auto`. {r['prompts_note']}"]
    for layout, lr in r["layouts"].items():
        lines += ["", f"### {layout}"]
        lines += _pass_head("Sweep", lr["sweep"])
        lines += _pass_head(f"Confirmation (the sweep's best gamma {lr['sweep_best_gamma']} and its neighbours "
                            "against auto, more repeats)", lr["confirm"])
        v = lr["verdict"]
        lines.append("")
        if not v["available"]:
            lines.append(f"Verdict: not available ({v['reason']}).")
            continue
        ok = "yes" if v["within_tolerance"] else "**no**"
        lines.append(_pairing(f"auto / best fixed gamma of the confirmation pass (gamma={v['best_fixed_gamma']})",
                              v["auto_vs_best"]) + f". Within 5 %: {ok}.")
        for name, p in v["auto_vs_each"].items():
            lines.append(f"- {_pairing(f'auto / {name}', p)}")
    return lines


def _md_repetitive(r: dict[str, Any]) -> list[str]:
    lines = ["## repetitive", "", r["prompts_note"] + " The ngram arm runs in process in every layout (no model, "
             "so no worker); select and onnx run in the layout named."]
    for layout, lr in r["layouts"].items():
        lines += ["", f"### {layout}", *_pass_head("Pass", lr)]
        lines += ["", "- " + _pairing("select / onnx", lr["select_vs"]["onnx"]),
                  "- " + _pairing("select / ngram", lr["select_vs"]["ngram"])]
        b = lr["verdict"]["select_beats_both"]
        lines.append(f"\nSelection beats both single strategies: {'-' if b is None else 'yes' if b else '**no**'}.")
    return lines


def _md_useless(r: dict[str, Any]) -> list[str]:
    lines = ["## useless-draft", "", f"An untrained draft ({r['draft']}) with `gamma: auto`. {r['prompts_note']}",
             *_pass_head("Pass", r["pass"])]
    lines.append("")
    for layout, v in r["verdict"].items():
        ok = "-" if v["within_tolerance"] is None else "yes" if v["within_tolerance"] else "**no**"
        lines.append(f"- {layout}: throughput / target-only {_x(v['ratio'])} (goal >= {r['tolerance']}): {ok}")
    return lines


MARKDOWN = {"gamma-sweep": _md_gamma_sweep, "repetitive": _md_repetitive, "useless-draft": _md_useless}


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = ["# hetero-spec bench: tuning scenarios", "", f"`{s['command']}`", "",
             f"{s['prompts']} prompts x {s['max_new_tokens']} new tokens, greedy, {report['machine']['cpu_count']} "
             f"CPUs ({report['machine']['cpu_model']}); {s['method']} Total {report['wall_s']:.0f} s.", ""]
    for name, r in report["scenarios"].items():
        lines += MARKDOWN[name](r) + ["", f"({name}: {r['scenario_wall_s']:.0f} s)", ""]
    return "\n".join(lines) + "\n"


def _figure(ncols: int, width: float = 5.5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _ok_medians(arms: dict[str, Any], names: Sequence[str]) -> list[tuple[str, float, float, float]]:
    out = []
    for n in names:
        e = arms.get(n) or {}
        if e.get("status") == "ok" and e.get("vs_target_only"):
            v = e["vs_target_only"]
            out.append((n, v["median"], v["min"], v["max"]))
    return out


def plot_gamma_sweep(r: dict[str, Any], path: Path) -> None:
    """Per layout: median speedup over target-only per fixed gamma (min-max bars), auto as a line; the
    confirmation pass's points on top."""
    fig, axes = _figure(len(r["layouts"]))
    for ax, (layout, lr) in zip(axes, r["layouts"].items()):
        for p, color, label in ((lr["sweep"], "#2a7ab9", "sweep"), (lr["confirm"], "#d04a02", "confirmation")):
            pts = [(int(n.split("=")[1]), m, lo, hi) for n, m, lo, hi in _ok_medians(p["arms"], list(p["arms"]))
                   if n.startswith("gamma=")]
            if pts:
                xs, ms, lo, hi = zip(*pts)
                ax.errorbar(xs, ms, yerr=[[m - a for m, a in zip(ms, lo)], [b - m for m, b in zip(ms, hi)]],
                            fmt="o-" if label == "sweep" else "s", color=color, capsize=3, label=f"fixed ({label})")
            auto = _ok_medians(p["arms"], ["auto"])
            if auto:
                ax.axhline(auto[0][1], color=color, linestyle="--", linewidth=1, label=f"auto ({label})")
        ax.axhline(1.0, color="black", linewidth=0.6)
        v = lr["verdict"]
        verdict = (f"auto/best {v['auto_vs_best']['median']:.3f}" if v.get("available") else "no verdict")
        ax.set_title(f"{layout}: {verdict}")
        ax.set_xlabel("gamma")
        ax.set_ylabel("throughput vs target-only (per prompt, median)")
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=120)


def _bars(ax, arms: dict[str, Any], title: str, line: float | None = None) -> None:
    rows = _ok_medians(arms, list(arms))
    ax.bar(range(len(rows)), [m for _, m, _, _ in rows], color="#2a7ab9",
           yerr=[[m - lo for _, m, lo, _ in rows], [hi - m for _, m, _, hi in rows]], capsize=4)
    ax.axhline(1.0, color="black", linewidth=0.6)
    if line is not None:
        ax.axhline(line, color="#d04a02", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(rows)), [n for n, *_ in rows], rotation=20, ha="right")
    for x, (_, m, _, hi) in enumerate(rows):
        ax.annotate(f"{m:.2f}x", (x, hi), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    ax.set_ylabel("throughput vs target-only (per prompt, median)")
    ax.set_title(title)


def plot_repetitive(r: dict[str, Any], path: Path) -> None:
    fig, axes = _figure(len(r["layouts"]))
    for ax, (layout, lr) in zip(axes, r["layouts"].items()):
        _bars(ax, lr["arms"], f"repetitive text, {layout}")
    fig.savefig(path, dpi=120)


def plot_useless(r: dict[str, Any], path: Path) -> None:
    fig, (ax,) = _figure(1)
    _bars(ax, r["pass"]["arms"], f"untrained draft, gamma auto (goal >= {r['tolerance']})", line=r["tolerance"])
    fig.savefig(path, dpi=120)


PLOTS = {"gamma-sweep": ("gamma_sweep.png", plot_gamma_sweep), "repetitive": ("repetitive.png", plot_repetitive),
         "useless-draft": ("useless_draft.png", plot_useless)}


def write_outputs(out: Path, report: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tuning.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "tuning.md").write_text(render_markdown(report))
    written = [out / "tuning.json", out / "tuning.md"]
    for name, r in report["scenarios"].items():
        fname, plot = PLOTS[name]
        plot(r, out / fname)
        written.append(out / fname)
    return written


# -- command line -------------------------------------------------------------------------------------
def scenario_settings(args) -> ScenarioSettings:
    """`hetero-spec bench --scenario ...` arguments -> settings; options of the system comparison that
    have no meaning here are refused, naming the option."""
    from ..config import parse_override

    scenarios = parse_scenarios(args.scenarios)
    for opt, given in (("--systems", args.systems), ("--ort-target", args.ort_target),
                       ("--sampling", args.sampling), ("--temperature", args.temperature)):
        if given:
            raise BenchError(f"{opt} does not apply with --scenario: the scenarios decode greedily with their "
                             "own arms (output identity with target-only is checked)")
    if getattr(args, "llama_cpp", None):
        raise BenchError("--llama-cpp applies to the system comparison, not to --scenario")
    if isinstance(args.prompts, str):
        raise BenchError(f"--prompts {args.prompts} applies to the system comparison; with --scenario "
                         "give the prompts with --prompts-file")
    for opt, val in (("--prompts", args.prompts), ("--max-new-tokens", args.max_new_tokens),
                     ("--repeats", args.repeats), ("--prompt-tokens", args.prompt_tokens)):
        if val is not None and val < 1:
            raise BenchError(f"{opt} must be >= 1, got {val}")
    return ScenarioSettings(
        config=Path(args.config), out=Path(args.out), scenarios=scenarios, prompts=args.prompts,
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, quick=args.quick,
        overrides=dict(parse_override(p) for p in args.overrides), prompt_tokens=args.prompt_tokens or 128,
        prompts_file=Path(args.prompts_file) if args.prompts_file else None,
        gammas=parse_gammas(args.gammas, args.quick), layouts=parse_layouts(args.layouts),
        draft_hf=Path(args.draft_hf) if args.draft_hf else None)


def command_line(s: ScenarioSettings) -> str:
    import shlex

    parts = ["hetero-spec", "bench", "--config", str(s.config), "--out", str(s.out), "--scenario",
             ",".join(s.scenarios), "--prompts", str(s.n_prompts), "--max-new-tokens", str(s.max_new)]
    if s.quick:
        parts.append("--quick")
    if "gamma-sweep" in s.scenarios:
        parts += ["--gammas", ",".join(map(str, s.gammas))]
    if s.layouts:
        parts += ["--layouts", ",".join(s.layouts)]
    if s.repeats:
        parts += ["--repeats", str(s.repeats)]
    return shlex.join(parts + input_flags(s))


def input_flags(s) -> list[str]:
    """The command-line flags of a bench's inputs, as given (prompt length and file, draft, --set overrides)."""
    parts: list[str] = []
    if s.prompt_tokens != 128:
        parts += ["--prompt-tokens", str(s.prompt_tokens)]
    if s.prompts_file:
        parts += ["--prompts-file", str(s.prompts_file)]
    if s.draft_hf:
        parts += ["--draft-hf", str(s.draft_hf)]
    for k, v in s.overrides.items():
        parts += ["--set", f"{k}={v if isinstance(v, str) else json.dumps(v)}"]
    return parts


def _prompt_sources(s: ScenarioSettings, config, n_sources: int) -> tuple[list[list[int]], bool]:
    """(prompt ids, from the user's file?) : the file's prompts, or n_sources held-out prompts."""
    from .prompts import heldout_prompt_ids, prompts_from_file

    if s.prompts_file is not None:
        return prompts_from_file(s.prompts_file, config), True
    return heldout_prompt_ids(config, s.config, n_sources, s.prompt_tokens), False


def build_prompts(s: ScenarioSettings, config) -> tuple[PromptSet | None, PromptSet | None]:
    """(held-out set, repetitive set), each only where a chosen scenario needs it. Warm-up prompts are held-out
    prompts beyond the timed ones (with --prompts-file: the file's first prompts, which are timed too)."""
    need_rep = "repetitive" in s.scenarios
    n, w = s.n_prompts, WARMUP_PROMPTS
    ids, from_file = _prompt_sources(s, config, 2 * (n + w) + 8 if need_rep else n + w)
    if from_file:
        n = s.prompts or len(ids)
        held = PromptSet(ids[:n], ids[:w], f"{n} prompts of {s.prompts_file}; warm-up: its first {w} (also timed).")
    else:
        held = PromptSet(ids[:n], ids[n:n + w],
                         f"{n} held-out prompts of {s.prompt_tokens} tokens; every engine first decodes {w} other "
                         "held-out prompts untimed (warm-up: gamma auto and selection learn from them).")
    rep = _repetitive_set(config, ids, n, 0 if from_file else w) if need_rep else None
    return (held if any(x != "repetitive" for x in s.scenarios) else None), rep


def _repetitive_set(config, sources: list[list[int]], n: int, w: int) -> PromptSet:
    """n timed + w warm-up repetitive prompts built from the source prompts' text (w = 0: the first timed
    prompts warm up too)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(config.target.model)
    built = repetitive_prompts([tok.decode(p) for p in sources], lambda t: tok.encode(t, add_special_tokens=False),
                               n + w)
    if len(built) < n + w or not built:
        raise BenchError(f"only {len(built)} of {len(sources)} source prompts have enough complete lines for a "
                         f"repetitive prompt; {n + w} needed")
    timed, warm = built[:n], built[n:] or built[:WARMUP_PROMPTS]
    sizes = f"{min(map(len, timed))}-{max(map(len, timed))} tokens"
    return PromptSet(timed, warm, f"{n} repetitive prompts ({sizes}): the complete lines of a source text, then its "
                                  "first half again, so that the continuation is likely a repeat; warm-up: "
                                  + (f"{w} more built the same way." if w else "the first ones (also timed)."))


def _check_context(config, sets: Sequence[PromptSet | None], max_new: int) -> None:
    from .run import context_len

    context = context_len(config)
    longest = max((len(p) for ps in sets if ps for p in ps.prompts + ps.warmup), default=0)
    if context is not None and longest + max_new > context:
        raise BenchError(f"prompts of up to {longest} tokens + {max_new} new tokens exceed the target's context "
                         f"of {context}: lower --prompt-tokens or --max-new-tokens")


def run_tuning(s: ScenarioSettings, make_runner: MakeRunner | None = None, say: Say = say_stderr) -> dict[str, Any]:
    """Run the scenarios of s on the demo pair (or any config) and write OUT/tuning.json, tuning.md, PNGs."""
    from ..config import check_paths, load_config
    from .report import _machine, _versions
    from .run import default_draft_hf

    t = time.perf_counter()
    base = {**s.overrides, **CPU_FP32}
    config = load_config(s.config, overrides=base)
    check_paths(config)
    held, rep = build_prompts(s, config)
    _check_context(config, (held, rep), s.max_new)
    source = s.draft_hf or default_draft_hf(s.config)
    if "useless-draft" in s.scenarios and source is None:
        raise BenchError("useless-draft: no Hugging Face draft to copy the architecture of; pass --draft-hf DIR")
    make = make_runner or (lambda engines, warmup: EngineRunner(
        s.config, base, engines, warmup, s.max_new, lambda text: say(f"  {text}")))
    sc = Scenario(settings=s, make_runner=make, heldout=held, repetitive=rep, say=say,
                  useless_draft=lambda: build_useless_draft(source, say=say))
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        scenarios = run_scenarios(sc)
    finally:
        hf_logging.set_verbosity(verbosity)
    report = {"machine": _machine(), "versions": _versions(),
              "config": {"source": config.source, **config.model_dump(mode="json")},
              "settings": {"command": command_line(s), "scenarios": s.scenarios, "prompts": s.n_prompts,
                           "max_new_tokens": s.max_new, "quick": s.quick,
                           "overrides": s.overrides, "method": METHOD},
              "scenarios": scenarios, "wall_s": round(time.perf_counter() - t, 1)}
    write_outputs(s.out, report)
    return report


METHOD = ("each pass interleaves its arms per prompt (the order rotating from prompt to prompt and repeat to "
          "repeat), takes the median of the repeats per prompt, and pairs every arm with target_only on the same "
          "prompt: throughput ratio (its tokens/s over target_only's), median over prompts, range, and prompts "
          "won; output token ids are compared with target_only's.")


def run_tuning_cli(args) -> int:
    s = scenario_settings(args)
    report = run_tuning(s)
    print(render_markdown(report), end="")
    print(f"[bench: {report['wall_s']:.0f} s; wrote {s.out / 'tuning.json'}, tuning.md and plots]", file=sys.stderr)
    return 0
