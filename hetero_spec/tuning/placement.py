"""Placement by measurement, `runtime.mode: auto` and `runtime.cpus: auto`: the layout and split of this machine's
cores with the best predicted goodput, from costs measured here (cached) or in a profile, including each side's
slowdown beside the other (`corun`); `Replacer` checks the choice again between requests
(docs/features-tuning.md#placement-layout-and-cores).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .controller import layout_rate
from .cost_model import CostModel, fit_line
from .profile import beside, decoder_token_s, prefilled, transfer_points, verify_once, verify_points

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

    @property
    def split(self) -> str:
        """The key of its side-by-side slowdowns in `Costs.corun`."""
        return f"{self.target_threads},{self.draft_threads}"


@dataclass
class Costs:
    """Measured seconds: verify line per target thread count, draft token per draft thread count."""

    verify: dict[int, tuple[float, float]]  # threads -> (verify_fixed_s, verify_per_token_s)
    draft_token_s: dict[int, float]  # threads -> seconds per draft token
    transfer_s: float = 0.0
    #: Layout.split (two processes) -> (target slowdown, draft slowdown) while both run: time beside / time alone
    corun: dict[str, tuple[float, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"verify": {str(t): [round(c0, 7), round(c1, 7)] for t, (c0, c1) in self.verify.items()},
                "draft_token_s": {str(t): round(s, 7) for t, s in self.draft_token_s.items()},
                "transfer_s": round(self.transfer_s, 7),
                "corun": {k: [round(a, 4), round(b, 4)] for k, (a, b) in self.corun.items()}}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Costs:
        return cls(verify={int(t): (float(v[0]), float(v[1])) for t, v in raw["verify"].items()},
                   draft_token_s={int(t): float(s) for t, s in raw["draft_token_s"].items()},
                   transfer_s=float(raw.get("transfer_s", 0.0)),
                   corun={k: (float(v[0]), float(v[1])) for k, v in (raw.get("corun") or {}).items()})

    def covers(self, layout: Layout) -> bool:
        return layout.target_threads in self.verify and layout.draft_threads in self.draft_token_s

    def model(self, layout: Layout) -> CostModel:
        """The layout's cost model; in two processes each side's solo cost times its slowdown beside the other."""
        c0, c1 = self.verify[layout.target_threads]
        draft = self.draft_token_s[layout.draft_threads]
        if layout.mode != "two_process":
            return CostModel(c0, c1, draft, 0.0)
        slow_t, slow_d = self.corun.get(layout.split, (1.0, 1.0))
        return CostModel(c0 * slow_t, c1 * slow_t, draft * slow_d, self.transfer_s)


def allowed_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def candidates(config, n_cpus: int) -> list[Layout]:
    """The layouts `runtime.mode` and `runtime.cpus` leave open on n_cpus cores (docs/features-tuning.md); with
    cpus not auto, the configured threads (target.threads unset: every core in process, those the worker leaves)."""
    runtime, t_cfg, d_cfg = config.runtime, config.target.threads, config.draft.threads
    auto_cpus = runtime.cpus == "auto"
    modes = ["in_process", "two_process"] if runtime.mode == "auto" else [runtime.mode]
    if config.draft.kind != "onnx":
        modes = ["in_process"]  # only a model draft runs in a worker
    out: list[Layout] = []
    if "in_process" in modes:
        if auto_cpus:
            out += [Layout("in_process", n_cpus, d) for d in sorted({1, n_cpus})]
        else:
            out.append(Layout("in_process", t_cfg or n_cpus, d_cfg))
    if "two_process" in modes and (n_cpus >= 2 or runtime.mode == "two_process"):
        if auto_cpus and n_cpus >= 2:
            out += [Layout("two_process", t, n_cpus - t) for t in range(1, n_cpus)]
        else:
            draft_threads = min(d_cfg, max(1, n_cpus - 1))
            out.append(Layout("two_process", t_cfg or max(1, n_cpus - draft_threads), draft_threads))
    return out


def predict(costs: Costs, layout: Layout, acceptance: float, speculating: bool = True) -> tuple[int, float]:
    """(the controller's gamma, predicted goodput in committed tokens/s) of a layout (controller.layout_rate)."""
    return layout_rate(costs.model(layout), acceptance, layout.mode, speculating)


def choose(costs: Costs, layouts: list[Layout], acceptance: float) -> tuple[Layout, list[dict[str, Any]]]:
    """The layout with the highest predicted goodput, and every candidate's prediction."""
    preds = [predict(costs, lay, acceptance) for lay in layouts]
    rows = [{**asdict(lay), "gamma": g, "predicted_tok_s": round(rate, 2)} for lay, (g, rate) in zip(layouts, preds)]
    best = max(range(len(layouts)), key=lambda i: rows[i]["predicted_tok_s"])
    return layouts[best], rows


# -- measuring --------------------------------------------------------------------------------------------
def _probe_prompt(vocab: int) -> list[int]:
    """64 token ids for timing only (their values do not change a pass's cost)."""
    return [(7 + 31 * i) % max(vocab, 2) for i in range(64)]


def measure_verify(target, reps: int = 7) -> tuple[float, float]:
    """The verify line (fixed, per token) of a loaded target, after a 64-token context."""
    c0, c1 = fit_line(verify_points(target, _probe_prompt(target.vocab_width), list(VERIFY_KS), reps))
    return max(c0, 0.0), max(c1, 0.0)


def _draft_decoder(config, threads: int, vocab: int):
    from ..onnx_decoder import OnnxDecoder
    return OnnxDecoder(config.draft.model, providers=config.draft.providers, threads=threads, vocab_width=vocab,
                       spin="run", kernels=config.runtime.kernels)


def _draft_token_s(dec, reps: int = 7) -> float:
    """Seconds per greedy draft token, 8 at a time after a 64-token context."""
    return decoder_token_s(dec, _probe_prompt(dec.model_vocab), reps)


def measure_corun(target, dec, reps: int = 7) -> tuple[float, float]:
    """(target slowdown, draft slowdown) of a two-process split: each side timed alone, then beside the other."""
    t_alone, d_alone = measure_verify(target, reps), _draft_token_s(dec, reps)
    t_beside = beside(lambda: _draft_token_s(dec, 1), lambda: measure_verify(target, reps))
    prompt, k = _probe_prompt(target.vocab_width), VERIFY_KS[-1]
    with prefilled(target, prompt) as ([state], base):
        d_beside = beside(lambda: verify_once(target, state, prompt, base, k), lambda: _draft_token_s(dec, reps))
    slow_t = (t_beside[0] + k * t_beside[1]) / max(t_alone[0] + k * t_alone[1], 1e-9)  # a block of 8 drafts
    return max(1.0, slow_t), max(1.0, d_beside / max(d_alone, 1e-9))


def measure(config, layouts: list[Layout], say=None) -> Costs:
    """Measure what the candidate layouts need (docs/features-tuning.md#placement-layout-and-cores)."""
    from ..target.backends import load_target, target_spin
    say = say or (lambda m: log.info("placement: %s", m))
    onnx = config.draft.kind == "onnx"
    costs = Costs(verify={}, draft_token_s={lay.draft_threads: 0.0 for lay in layouts})
    for threads in sorted({lay.target_threads for lay in layouts}):
        say(f"target verification at {threads} thread(s)")
        target = load_target(config.target, threads, spin=target_spin(config), kernels=config.runtime.kernels)
        costs.verify[threads], vocab = measure_verify(target), target.vocab_width
        for lay in layouts:
            if onnx and lay.mode == "two_process" and lay.target_threads == threads:
                say(f"target and draft side by side, {threads} + {lay.draft_threads} thread(s)")
                costs.corun[lay.split] = measure_corun(target, _draft_decoder(config, lay.draft_threads, vocab))
        del target  # before the next thread count loads its own
    if onnx:
        for threads in sorted(costs.draft_token_s):
            say(f"draft time per token at {threads} thread(s)")
            costs.draft_token_s[threads] = _draft_token_s(_draft_decoder(config, threads, vocab))
        if any(lay.mode == "two_process" for lay in layouts):
            costs.transfer_s = transfer_points([64], 20)[0][1]
    return costs


# -- caching and resolving --------------------------------------------------------------------------------
def _stamp(path: Path | None) -> list[Any] | None:
    if path is None:
        return None
    path = Path(path).resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [str(path), [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]]


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    return names[0] if names else platform.processor()


def cache_path(config, layouts: list[Layout]) -> Path:
    """Where the measured costs are cached: keyed by the models, the backend, this machine and the layouts."""
    from ..target.export_cache import cache_root
    target, draft = config.target, config.draft
    key = {"target": _stamp(target.model), "backend": target.backend, "providers": target.providers,
           "device": target.device, "dtype": target.dtype, "precision": target.precision,
           "draft": _stamp(draft.model) if draft.kind == "onnx" else draft.kind, "draft_providers": draft.providers,
           "host": platform.node(), "cpu": _cpu_model(), "cpus": allowed_cpus(),
           "threads": sorted({(lay.target_threads, lay.draft_threads) for lay in layouts}), "version": CACHE_VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root() / "placement" / f"{digest}.json"


def cached_costs(config, layouts: list[Layout], say=None) -> tuple[Costs, str, Path]:
    """Costs from the cache, or measured now and cached; (costs, where they came from, the cache file)."""
    path = cache_path(config, layouts)
    if path.is_file():
        try:
            return Costs.from_dict(json.loads(path.read_text())), f"cached measurement {path}", path
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: measure again
    costs = measure(config, layouts, say)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(costs.to_dict()))
    os.replace(tmp, path)
    return costs, f"measured now (cached in {path})", path


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
    config.runtime.mode, config.runtime.cpus = layout.mode, None
    config.target.threads, config.draft.threads = layout.target_threads, layout.draft_threads
    config.runtime.pin_cpus = config.runtime.pin_cpus or layout.mode == "two_process"
    return config


def resolve(config, acceptance: float, say=None) -> tuple[Any, dict[str, Any]]:
    """Resolve `runtime.mode: auto` / `runtime.cpus: auto`: (the config set to the chosen layout, a report)."""
    layouts = candidates(config, allowed_cpus())
    if config.draft.kind == "none":  # the target alone: every core, nothing to measure
        threads = config.target.threads if config.runtime.cpus != "auto" else None
        layouts = [Layout("in_process", threads or allowed_cpus(), config.draft.threads)]
    costs, cache_file = None, None
    if len(layouts) == 1:
        best, rows, why = layouts[0], [asdict(layouts[0])], "the only layout this config and machine allow"
    else:
        costs = profile_costs(config.speculation.profile)
        if costs is not None and all(costs.covers(lay) for lay in layouts):
            source = f"profile {config.speculation.profile}"
        else:
            costs, source, path = cached_costs(config, layouts, say)
            cache_file = str(path)
        best, rows = choose(costs, layouts, acceptance)
        why = f"best predicted goodput at acceptance {acceptance:.3f} ({source})"
    log.info("placement: %s; %s", best.label(), why)
    return apply(config, best), {"chosen": asdict(best), "why": why, "candidates": rows,
                                 "costs": costs.to_dict() if costs else None, "cache_file": cache_file}


# -- re-placing from what the engine observes ---------------------------------------------------------------------
#: a layout observed below this share of its prediction had its costs measured under other conditions (a busy
#: machine, say): its cached measurement is dropped, so the next Engine measures again
STALE_SHARE = 0.7


def replacement(costs: Costs, layouts: list[Layout], now: Layout, acceptance: float, observed: dict[Layout, float],
                gain: float, spec_off: bool = False) -> tuple[Layout | None, str, bool]:
    """(the layout to move to or None, why, whether the costs look stale) between requests. A layout's rate is its
    observed goodput where the engine has run it, else the prediction at the measured acceptance: a layout slower
    than predicted is left as soon as one request shows it, and not taken back on a prediction."""
    def rate(lay: Layout) -> tuple[float, str]:
        return (observed[lay], "observed") if lay in observed else (predict(costs, lay, acceptance)[1], "predicted")
    rate_now, how_now = rate(now)
    if spec_off and now not in observed:  # what runs now is the target alone
        rate_now, how_now = predict(costs, now, acceptance, speculating=False)[1], "predicted, speculation off"
    best = max(layouts, key=lambda lay: rate(lay)[0])
    rate_best, how_best = rate(best)
    stale = now in observed and observed[now] < STALE_SHARE * predict(costs, now, acceptance)[1]
    if best == now or rate_best < gain * rate_now:
        return None, "", stale
    why = (f"measured acceptance {acceptance:.3f}{' and speculation off' if spec_off else ''}: {best.label()} "
           f"{rate_best:.1f} tok/s ({how_best}) against {rate_now:.1f} ({how_now}) for {now.label()}")
    return best, why, stale


class Replacer:
    """Placement by measurement, continued, between requests (when: docs/features-tuning.md): the first choice
    assumed an acceptance; a layout predicted (or observed) GAIN x faster is returned for the Engine to apply."""

    MIN_TESTED = 16  # tested draft tokens since the last switch before the acceptance may move the placement
    GAIN = 1.10
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
        if self.placement.get("costs") is None:
            return None
        costs, now = Costs.from_dict(self.placement["costs"]), Layout(**self.placement["chosen"])
        layouts = [lay for lay in candidates(self.config, allowed_cpus()) if costs.covers(lay)]
        if not costs.covers(now) or not layouts:
            return None
        # two processes, and the last request drafted nothing: the target is decoding alone, on fewer cores
        spec_off = mode_now == "two_process" and self.last_drafted == 0
        # a draft worker holds cores, and at this acceptance gamma auto drafts nothing (so no more tokens will be
        # tested; waiting for MIN_TESTED of them would keep the target on its share of cores for good)
        idle_worker = now.mode == "two_process" and predict(costs, now, acceptance)[0] == 0
        if (tested - self.tested_at_switch < self.MIN_TESTED and not spec_off and not idle_worker
                and now not in self.observed):
            return None
        observed = {lay: statistics.median(r) for lay, r in self.observed.items() if r}
        best, why, stale = replacement(costs, layouts, now, acceptance, observed, self.GAIN, spec_off)
        path = self.placement.get("cache_file")
        if stale and path and Path(path).is_file():
            # measured under other conditions (another job on the machine, say): the next Engine measures again
            Path(path).unlink(missing_ok=True)
            log.info("placement: %s decodes at %.1f tok/s against %.1f predicted; dropped the cached "
                     "measurement %s", now.label(), observed[now], predict(costs, now, acceptance)[1], path)
            self.placement["cache_dropped"] = path
        return None if best is None else (best, why, choose(costs, layouts, acceptance)[1])

    def switched(self, best: Layout, why: str, rows: list, tested: float) -> None:
        self.tested_at_switch = tested
        self.placement["switches"].append({"from": self.placement["chosen"], "to": asdict(best), "why": why})
        self.placement.update(chosen=asdict(best), candidates=rows)
