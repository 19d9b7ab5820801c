"""Placement by measurement: `runtime.mode: auto` and `runtime.cpus: auto`.

Which layout, and which split of this machine's cores, gives the best predicted goodput?

- in_process: the draft and the target in turn, each free to use every core (`target.threads`, `draft.threads`).
- two_process: the draft worker drafts on its own cores while the target verifies on the rest.

On 2 cores the answer is not obvious: the worker hides the draft's time, but the target loses a core. The
demo target verifies 9 tokens in about 4.0 ms on one thread and 2.3 ms on two, which is more than the draft
time the worker hides.

What is measured (in this process, a few seconds; cached in $HETERO_SPEC_CACHE/placement, keyed by the
models, the backend and this machine, or taken from `speculation.profile` when that profile measured them):

- the target's verification time for blocks of 0, 4 and 8 drafts, at each candidate thread count, fitted as a
  line (tuning/cost_model.py);
- the draft's time per token at each candidate thread count;
- the transfer time of one message (ZeroMQ over IPC);
- for each two-process split, how much slower each side runs while the other runs beside it (`corun`): both
  read weights over one memory bus, so a target bound by bandwidth loses speed to a draft on the next core
  (measured here: 1.5B int4 target on one core, 23 tok/s alone; a layout predicted from solo costs ran at 0.86x
  the target alone on both cores). A layout predicted from solo costs would be picked where it loses.

Each candidate's goodput is the cost model's, at its best gamma, with the acceptance the engine knows (the
profile's, or the default prior before it has seen a request). The choice, the predictions and the measured
costs are logged and kept in `Engine.placement`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .cost_model import CostModel, fit_line
from .profile import decoder_token_s, transfer_points, verify_points

#: the cache entries' format: 2 added the side-by-side slowdowns (an entry without them is measured again)
CACHE_VERSION = 2

log = logging.getLogger("hetero_spec.placement")

VERIFY_KS = (0, 4, 8)  # block lengths the verify line is fitted to


@dataclass(frozen=True)
class Layout:
    mode: str  # in_process | two_process
    target_threads: int
    draft_threads: int

    def label(self) -> str:
        return f"{self.mode} (target {self.target_threads} thread(s), draft {self.draft_threads})"


@dataclass
class Costs:
    """Measured seconds: verify line per target thread count, draft token per draft thread count."""

    verify: dict[int, tuple[float, float]]  # threads -> (verify_fixed_s, verify_per_token_s)
    draft_token_s: dict[int, float]  # threads -> seconds per draft token
    transfer_s: float = 0.0
    #: "T,D" (a two-process split) -> (target slowdown, draft slowdown) while both run: time beside / time alone
    corun: dict[str, tuple[float, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"verify": {str(t): [round(c0, 7), round(c1, 7)] for t, (c0, c1) in self.verify.items()},
                "draft_token_s": {str(t): round(s, 7) for t, s in self.draft_token_s.items()},
                "transfer_s": round(self.transfer_s, 7),
                "corun": {k: [round(a, 4), round(b, 4)] for k, (a, b) in self.corun.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Costs:
        return cls(verify={int(t): (float(v[0]), float(v[1])) for t, v in d["verify"].items()},
                   draft_token_s={int(t): float(s) for t, s in d["draft_token_s"].items()},
                   transfer_s=float(d.get("transfer_s", 0.0)),
                   corun={k: (float(v[0]), float(v[1])) for k, v in (d.get("corun") or {}).items()})

    def model(self, layout: Layout) -> CostModel:
        """The layout's cost model: in two processes each side's solo cost times its measured slowdown beside
        the other (1.0 where none was measured: a profile from before corun, or a machine with cores to spare)."""
        c0, c1 = self.verify[layout.target_threads]
        draft = self.draft_token_s[layout.draft_threads]
        if layout.mode != "two_process":
            return CostModel(c0, c1, draft, 0.0)
        slow_t, slow_d = self.corun.get(f"{layout.target_threads},{layout.draft_threads}", (1.0, 1.0))
        return CostModel(c0 * slow_t, c1 * slow_t, draft * slow_d, self.transfer_s)


def allowed_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def candidates(config, n_cpus: int) -> list[Layout]:
    """The layouts `runtime.mode` and `runtime.cpus` leave open on n_cpus cores.

    runtime.cpus auto: in process, the target on every core and the draft on one or every core; two-process,
    every split of the cores between target and worker. Otherwise the configured threads (target.threads
    unset: every core in process, the cores the worker leaves in two_process)."""
    rt, t_cfg, d_cfg = config.runtime, config.target.threads, config.draft.threads
    auto_cpus = rt.cpus == "auto"
    modes = ["in_process", "two_process"] if rt.mode == "auto" else [rt.mode]
    if config.draft.kind != "onnx":
        modes = ["in_process"]  # only a model draft runs in a worker
    out: list[Layout] = []
    if "in_process" in modes:
        if auto_cpus:
            out += [Layout("in_process", n_cpus, d) for d in sorted({1, n_cpus})]
        else:
            out.append(Layout("in_process", t_cfg or n_cpus, d_cfg))
    if "two_process" in modes and (n_cpus >= 2 or rt.mode == "two_process"):
        if auto_cpus and n_cpus >= 2:
            out += [Layout("two_process", t, n_cpus - t) for t in range(1, n_cpus)]
        else:
            d = min(d_cfg, max(1, n_cpus - 1))
            out.append(Layout("two_process", t_cfg or max(1, n_cpus - d), d))
    return out


def predict(costs: Costs, layout: Layout, acceptance: float, g_max: int = 16) -> tuple[int, float]:
    """(best gamma, predicted goodput in committed tokens/s) of a layout."""
    return costs.model(layout).best_gamma(acceptance, layout.mode, g_max)


def choose(costs: Costs, layouts: list[Layout], acceptance: float) -> tuple[Layout, list[dict[str, Any]]]:
    """The layout with the highest predicted goodput, and every candidate's prediction."""
    rows = []
    for lay in layouts:
        g, rate = predict(costs, lay, acceptance)
        rows.append({**asdict(lay), "gamma": g, "predicted_tok_s": round(rate, 2)})
    best = max(range(len(layouts)), key=lambda i: rows[i]["predicted_tok_s"])
    return layouts[best], rows


# -- measuring --------------------------------------------------------------------------------------------
def _probe_prompt(vocab: int, n: int = 64) -> list[int]:
    """Token ids for timing only (their values do not change a pass's cost)."""
    return [(7 + 31 * i) % max(vocab, 2) for i in range(n)]


def measure_verify(target, reps: int = 7) -> tuple[float, float]:
    """The verify line (fixed, per token) of a loaded target, after a 64-token context."""
    points = verify_points(target, _probe_prompt(target.vocab_width), list(VERIFY_KS), reps)
    c0, c1 = fit_line([(float(x), y) for x, y in points])
    return max(c0, 0.0), max(c1, 0.0)


def measure_draft(model_dir: Path, providers: list[str], threads: int, vocab: int, reps: int = 7) -> float:
    """Seconds per greedy draft token of the ONNX draft at `threads`, 8 at a time after a 64-token context."""
    from ..onnx_decoder import OnnxDecoder

    dec = OnnxDecoder(model_dir, providers=providers, threads=threads, vocab_width=vocab, spin=False)
    return decoder_token_s(dec, _probe_prompt(dec.model_vocab), reps)


def _beside(background, measure_fn):
    """measure_fn() while background() runs in a loop in a thread (ONNX Runtime and torch release the GIL while
    they compute, so the two run on separate cores as the worker and the target do)."""
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            background()

    th = threading.Thread(target=loop, name="hetero-spec-corun", daemon=True)
    th.start()
    try:
        return measure_fn()
    finally:
        stop.set()
        th.join()


def measure_corun(config, layout: Layout, vocab: int, reps: int = 7) -> tuple[float, float]:
    """(target slowdown, draft slowdown) of a two-process split: each side timed alone, then beside the other."""
    from ..onnx_decoder import OnnxDecoder
    from ..target.backends import load_target

    target = load_target(config.target, layout.target_threads, spin=False)
    dec = OnnxDecoder(config.draft.model, providers=config.draft.providers, threads=layout.draft_threads,
                      vocab_width=vocab, spin=False)
    prompt = _probe_prompt(vocab)
    t_alone, d_alone = measure_verify(target, reps), decoder_token_s(dec, _probe_prompt(dec.model_vocab), reps)
    t_beside = _beside(lambda: decoder_token_s(dec, _probe_prompt(dec.model_vocab), 1),
                       lambda: measure_verify(target, reps))
    state = target.new_state()
    target.prefill(state, prompt)
    base = state.n_cached

    def verify_once():
        target.verify(state, prompt[-1], prompt[:VERIFY_KS[-1]], True)
        target.rollback(state, base)

    d_beside = _beside(verify_once, lambda: decoder_token_s(dec, _probe_prompt(dec.model_vocab), reps))
    target.release_state(state)
    cost = lambda line: line[0] + VERIFY_KS[-1] * line[1]  # noqa: E731 - a block of 8 drafts
    return max(1.0, cost(t_beside) / max(cost(t_alone), 1e-9)), max(1.0, d_beside / max(d_alone, 1e-9))


def measure(config, layouts: list[Layout], say=None) -> Costs:
    """Measure what the candidate layouts need (see the module docstring)."""
    from ..target.backends import load_target

    say = say or (lambda m: log.info("placement: %s", m))
    verify, draft = {}, {}
    vocab = None
    for t in sorted({lay.target_threads for lay in layouts}):
        say(f"target verification at {t} thread(s)")
        target = load_target(config.target, t, spin=False)
        verify[t] = measure_verify(target)
        vocab = target.vocab_width
        del target
    transfer = 0.0
    if config.draft.kind == "onnx":
        for d in sorted({lay.draft_threads for lay in layouts}):
            say(f"draft time per token at {d} thread(s)")
            draft[d] = measure_draft(config.draft.model, config.draft.providers, d, vocab)
        if any(lay.mode == "two_process" for lay in layouts):
            transfer = transfer_points([64], 20)[0][1]
    else:
        draft = {lay.draft_threads: 0.0 for lay in layouts}
    corun = {}
    for lay in layouts:
        if lay.mode == "two_process" and config.draft.kind == "onnx":
            say(f"target and draft side by side, {lay.target_threads} + {lay.draft_threads} thread(s)")
            corun[f"{lay.target_threads},{lay.draft_threads}"] = measure_corun(config, lay, vocab)
    return Costs(verify=verify, draft_token_s=draft, transfer_s=transfer, corun=corun)


# -- caching and resolving --------------------------------------------------------------------------------
def _stamp(path: Path | None) -> list[Any] | None:
    if path is None:
        return None
    path = Path(path).resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [str(path), [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cache_key(config, layouts: list[Layout]) -> str:
    t, d = config.target, config.draft
    key = {"target": _stamp(t.model), "backend": t.backend, "providers": t.providers, "device": t.device,
           "dtype": t.dtype, "precision": t.precision, "draft": _stamp(d.model) if d.kind == "onnx" else d.kind,
           "draft_providers": d.providers, "host": platform.node(), "cpu": _cpu_model(), "cpus": allowed_cpus(),
           "threads": sorted({(lay.target_threads, lay.draft_threads) for lay in layouts}), "version": CACHE_VERSION}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_path(config, layouts: list[Layout]) -> Path:
    from ..target.export_cache import cache_root

    return cache_root() / "placement" / f"{cache_key(config, layouts)}.json"


def cached_costs(config, layouts: list[Layout], say=None) -> tuple[Costs, str]:
    """Costs from the cache, or measured now and cached; (costs, where they came from)."""
    path = cache_path(config, layouts)
    if path.is_file():
        try:
            return Costs.from_dict(json.loads(path.read_text())), f"cached measurement {path}"
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: measure again
    costs = measure(config, layouts, say)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(costs.to_dict()))
    os.replace(tmp, path)
    return costs, f"measured now (cached in {path})"


def profile_costs(profile_path: Path | None) -> Costs | None:
    """The placement costs a profile measured (`hetero-spec profile`), if any."""
    if profile_path is None:
        return None
    import yaml

    try:
        raw = yaml.safe_load(Path(profile_path).read_text()) or {}
        return Costs.from_dict(raw["placement"]["costs"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None


def apply(config, layout: Layout):
    """A copy of config set to the layout (mode, threads; the worker pinned to its own cores)."""
    config = config.model_copy(deep=True)
    config.runtime.mode = layout.mode
    config.runtime.cpus = None
    config.target.threads = layout.target_threads
    config.draft.threads = layout.draft_threads
    if layout.mode == "two_process":
        config.runtime.pin_cpus = True
    return config


def resolve(config, acceptance: float, say=None) -> tuple[Any, dict[str, Any]]:
    """Resolve `runtime.mode: auto` / `runtime.cpus: auto`: (the config set to the chosen layout, a report)."""
    layouts = candidates(config, allowed_cpus())
    if config.draft.kind == "none":  # the target alone: every core, nothing to measure
        layouts = [Layout("in_process", config.target.threads if config.runtime.cpus != "auto" and
                          config.target.threads else allowed_cpus(), config.draft.threads)]
    costs = None
    source, cache_file = "", None
    if len(layouts) > 1:
        costs = profile_costs(config.speculation.profile)
        if costs is not None and all(lay.target_threads in costs.verify and lay.draft_threads in costs.draft_token_s
                                     for lay in layouts):
            source = f"profile {config.speculation.profile}"
        else:
            costs, source = cached_costs(config, layouts, say)
            cache_file = str(cache_path(config, layouts))
        best, rows = choose(costs, layouts, acceptance)
    else:
        best, rows = layouts[0], [asdict(layouts[0])]
        source = "the only layout this config and machine allow"
    report = {"chosen": asdict(best), "why": f"best predicted goodput at acceptance {acceptance:.3f} ({source})"
              if costs is not None else source, "candidates": rows,
              "costs": costs.to_dict() if costs is not None else None, "cache_file": cache_file}
    log.info("placement: %s; %s", best.label(), report["why"])
    return apply(config, best), report


# -- re-placing from what the engine observes ---------------------------------------------------------------------
#: a layout observed below this share of its prediction had its costs measured under other conditions (a busy
#: machine, say): its cached measurement is dropped, so the next Engine measures again
STALE_SHARE = 0.7


def replacement(costs: Costs, layouts: list[Layout], now: Layout, acceptance: float,
                observed: dict[Layout, float], gain: float, spec_off: bool = False
                ) -> tuple[Layout | None, str, bool]:
    """(the layout to move to or None, why, whether the costs look stale) between requests.

    Each layout's rate is its observed decoding goodput where the engine has run it (observed), else the cost
    model's prediction at the measured acceptance. So a layout that was picked from a prediction but decodes
    slower than the target alone on every core is left as soon as one request shows it, and a layout left for
    its observed rate is not taken back on a prediction."""
    def rate(lay: Layout) -> tuple[float, str]:
        if lay in observed:
            return observed[lay], "observed"
        return predict(costs, lay, acceptance)[1], "predicted"

    rate_now, how_now = rate(now)
    if spec_off and now not in observed:  # what runs now is the target alone
        rate_now, how_now = 1.0 / costs.model(now).verify(0), "predicted, speculation off"
    best = max(layouts, key=lambda lay: rate(lay)[0])
    rate_best, how_best = rate(best)
    stale = now in observed and observed[now] < STALE_SHARE * predict(costs, now, acceptance)[1]
    if best == now or rate_best < gain * rate_now:
        return None, "", stale
    why = (f"measured acceptance {acceptance:.3f}{' and speculation off' if spec_off else ''}: {best.label()} "
           f"{rate_best:.1f} tok/s ({how_best}) against {rate_now:.1f} ({how_now}) for {now.label()}")
    return best, why, stale


class Replacer:
    """Placement by measurement, continued, between requests. The first choice assumed an acceptance (the
    profile's, or the prior). Once the draft's acceptance is measured, or a request decoded alone shows a layout's
    real goodput, a layout predicted (or observed) `gain` x faster is returned for the Engine to apply (a draft
    that never agrees ends with the target alone on every core)."""

    MIN_TESTED = 16  # tested draft tokens since the last switch before the acceptance may move the placement
    GAIN = 1.10
    OBSERVE_MIN_TOKENS = 16  # a request decoded alone with at least this many tokens shows its layout's goodput
    OBSERVE_LAST = 3  # a layout's observed goodput: the median of its last few requests

    def __init__(self, config, placement: dict[str, Any]):
        self.config, self.placement = config, placement  # the auto config, and the Engine's placement record
        self.observed: dict[Layout, list[float]] = {}
        self.tested_at_switch = 0.0
        self.last_drafted: int | None = None

    def observe(self, new_tokens: int, decode_s: float, drafted: int, batched: bool, min_tokens: int) -> None:
        """A finished request: its decoding goodput, kept per layout (requests that shared rounds say little)."""
        self.last_drafted = drafted
        if batched or new_tokens < min_tokens or decode_s <= 0 or "chosen" not in self.placement:
            return
        runs = self.observed.setdefault(Layout(**self.placement["chosen"]), [])
        runs.append(new_tokens / decode_s)
        del runs[:-self.OBSERVE_LAST]

    def decide(self, mode_now: str, tested: float, acceptance: float) -> tuple[Layout, str, list] | None:
        """(the layout to move to, why, every candidate's prediction), or None to stay."""
        import statistics

        if self.placement.get("costs") is None:
            return None
        costs = Costs.from_dict(self.placement["costs"])
        now = Layout(**self.placement["chosen"])
        if now.target_threads not in costs.verify or now.draft_threads not in costs.draft_token_s:
            return None
        # two processes, and the last request drafted nothing: the target is decoding alone, on fewer cores
        spec_off = mode_now == "two_process" and self.last_drafted == 0
        # a draft worker holds cores, and at this acceptance gamma auto drafts nothing (so no more tokens will be
        # tested; waiting for MIN_TESTED of them would keep the target on its share of cores for good)
        idle_worker = now.mode == "two_process" and predict(costs, now, acceptance)[0] == 0
        if (tested - self.tested_at_switch < self.MIN_TESTED and not spec_off and not idle_worker
                and now not in self.observed):
            return None
        layouts = [lay for lay in candidates(self.config, allowed_cpus())
                   if lay.target_threads in costs.verify and lay.draft_threads in costs.draft_token_s]
        if not layouts:
            return None
        observed = {lay: statistics.median(r) for lay, r in self.observed.items() if r}
        best, why, stale = replacement(costs, layouts, now, acceptance, observed, self.GAIN, spec_off)
        if stale:
            self._drop_stale_costs(now, observed[now], predict(costs, now, acceptance)[1])
        if best is None:
            return None
        return best, why, choose(costs, layouts, acceptance)[1]

    def switched(self, best: Layout, why: str, rows: list, tested: float) -> None:
        self.tested_at_switch = tested
        self.placement["switches"].append({"from": self.placement["chosen"], "to": asdict(best), "why": why})
        self.placement.update(chosen=asdict(best), candidates=rows)

    def _drop_stale_costs(self, now: Layout, observed: float, predicted: float) -> None:
        """The layout decodes far below its prediction: the cached measurement was made under other conditions
        (another job on the machine, say). Drop it, so the next Engine measures again instead of keeping it."""
        path = self.placement.get("cache_file")
        if path and Path(path).is_file():
            Path(path).unlink(missing_ok=True)
            log.info("placement: %s decodes at %.1f tok/s against %.1f predicted; dropped the cached "
                     "measurement %s", now.label(), observed, predicted, path)
            self.placement["cache_dropped"] = path
