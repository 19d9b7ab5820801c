"""`hetero-spec bench`: the engine side by side with its baselines, on the same prompts and machine.

Every system decodes the same held-out prompts (token ids, so every system sees identical inputs) greedily,
interleaved per prompt (A B C A B C ...) so that machine noise hits all systems alike. Each system gets one
untimed warm-up first. Results land in DIR/bench.json (schema below), DIR/bench.md and DIR/bench.png.

Systems are a registry: a name -> a small class with `setup(ctx)`, `run(prompt_ids, max_new) -> RunOutput`
and `close()`, plus `unavailable(ctx)`, which says why the system cannot run here (or None). Adding a
system is registering one more class.

bench.json, top level: machine, versions, config (resolved), settings, systems (a list, one entry per
system, in run order), analytic. Each system entry:
    name, status ("ok" | "skipped" | "unavailable" | "failed"), reason (why not ok, else null),
    tokens_per_s (median over prompts), speedup_vs_target_only (median of per-prompt time ratios),
    acceptance_rate (null where meaningless), identical_to_target_only, per_prompt (raw: wall_s,
    new_tokens, tokens_per_s, speedup_vs_target_only, identical_to_target_only, stats), extra.
ORT GenAI systems also carry identical_to_ort_genai_target_only.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import platform
import shlex
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Config, RuntimeConfig, check_paths, load_config, parse_override
from .errors import HeteroSpecError

log = logging.getLogger("hetero_spec.bench")

DEFAULT_PROMPTS, DEFAULT_MAX_NEW = 12, 128
QUICK_PROMPTS, QUICK_MAX_NEW = 4, 64
DEFAULT_PROMPT_TOKENS = 128
WARMUP_TOKENS = 16
CALIBRATION_K = (2, 4, 6)
# The bench compares against transformers fp32 on CPU; the hetero_spec systems must run the same way.
CPU_FP32 = {"target.device": "cpu", "target.dtype": "float32"}


class BenchError(HeteroSpecError):
    """The benchmark cannot run as asked (bad system list, no prompts, the baseline failed)."""


# -- settings and shared context ---------------------------------------------------------------------
@dataclass
class BenchSettings:
    """What to run. None means the default (12 prompts x 128 tokens; 4 x 64 with quick)."""

    config: Path
    out: Path
    prompts: int | None = None
    max_new_tokens: int | None = None
    systems: list[str] | None = None
    quick: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)
    draft_hf: Path | None = None
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    ort_target: Path | None = None
    """An existing fp32 ONNX export of the target (model builder output); None exports it under out."""

    @property
    def n_prompts(self) -> int:
        return self.prompts or (QUICK_PROMPTS if self.quick else DEFAULT_PROMPTS)

    @property
    def max_new(self) -> int:
        return self.max_new_tokens or (QUICK_MAX_NEW if self.quick else DEFAULT_MAX_NEW)


@dataclass
class RunOutput:
    """What one system produced for one prompt: generated ids only (no prompt), and its own statistics."""

    token_ids: list[int]
    stats: dict[str, Any] | None = None


@dataclass
class BenchContext:
    """Everything systems share: the resolved config, paths, prompts, and models loaded once."""

    config: Config
    overrides: dict[str, Any]
    out: Path
    draft_hf: Path | None
    prompts: list[list[int]]
    max_new: int
    torch_threads: int
    ort_target: Path | None = None
    _hf_models: dict[Path, Any] = field(default_factory=dict)

    @property
    def gamma(self) -> int:
        return self.config.speculation.gamma

    def hf_model(self, model_dir: Path):
        """A transformers causal LM in fp32 on CPU, loaded once per bench and shared by the baselines."""
        model_dir = Path(model_dir)
        if model_dir not in self._hf_models:
            self._hf_models[model_dir] = load_hf(model_dir)
        return self._hf_models[model_dir]


def load_hf(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# -- systems ------------------------------------------------------------------------------------------
class System:
    """Base of a benchmarked system. Subclasses set `name` and implement setup/run (close if needed)."""

    name = "?"
    #: (accepted, drafted) keys of the system's per-run stats, for a per-token acceptance rate; None: n/a
    acceptance_keys: tuple[str, str] | None = None

    @staticmethod
    def unavailable(ctx: BenchContext) -> str | None:
        """Why this system cannot run here (shown in the report), or None."""
        return None

    def setup(self, ctx: BenchContext) -> None:
        raise NotImplementedError

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def extra(self) -> dict[str, Any]:
        """System-specific facts for the report (e.g. the calibrated constant)."""
        return {}


SYSTEMS: dict[str, type[System]] = {}


def register(cls: type[System]) -> type[System]:
    """Add a system to the registry; registration order is the run order within each prompt."""
    if cls.name in SYSTEMS:
        raise ValueError(f"system {cls.name!r} is registered twice")
    SYSTEMS[cls.name] = cls
    return cls


def _hf_generate(model, prompt_ids: list[int], max_new: int, **kwargs) -> list[int]:
    import torch

    ids = torch.tensor([prompt_ids], dtype=torch.long)
    pad = model.generation_config.pad_token_id
    eos = model.generation_config.eos_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos) or 0
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=0, do_sample=False, num_beams=1, pad_token_id=pad, **kwargs)
    return out[0, len(prompt_ids):].tolist()


@register
class TargetOnly(System):
    """transformers `generate(do_sample=False)` on the target alone, fp32 on CPU: the reference."""

    name = "target_only"

    def setup(self, ctx: BenchContext) -> None:
        self.model = ctx.hf_model(ctx.config.target.model)

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        return RunOutput(_hf_generate(self.model, prompt_ids, max_new))


@register
class HfAssisted(System):
    """transformers assisted generation, the draft's PyTorch checkpoint as assistant, default schedule."""

    name = "hf_assisted"

    @staticmethod
    def unavailable(ctx: BenchContext) -> str | None:
        if ctx.draft_hf is None or not (ctx.draft_hf / "config.json").is_file():
            return (f"no PyTorch draft checkpoint at {ctx.draft_hf} (pass --draft-hf DIR, a Hugging Face "
                    "directory of the draft model)")
        return None

    def setup(self, ctx: BenchContext) -> None:
        self.target = ctx.hf_model(ctx.config.target.model)
        self.assistant = load_hf(ctx.draft_hf)  # its own copy: best_const edits its generation_config

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        return RunOutput(_hf_generate(self.target, prompt_ids, max_new, assistant_model=self.assistant))


@register
class HfAssistedBestConst(HfAssisted):
    """Assisted generation with the best constant number of assistant tokens (calibrated on prompt 0)."""

    name = "hf_assisted_best_const"

    def setup(self, ctx: BenchContext) -> None:
        super().setup(ctx)
        gc = self.assistant.generation_config
        gc.num_assistant_tokens_schedule = "constant"
        gc.assistant_confidence_threshold = 0.0  # a pure constant: no early stop on low draft confidence
        self.calibration: dict[int, float] = {}
        prompt = ctx.prompts[0]
        self.run(prompt, min(WARMUP_TOKENS, ctx.max_new))  # untimed: this assistant copy is still cold
        for k in CALIBRATION_K:
            gc.num_assistant_tokens = k
            t = time.perf_counter()
            self.run(prompt, ctx.max_new)
            self.calibration[k] = time.perf_counter() - t
        self.best_k = min(self.calibration, key=self.calibration.get)
        gc.num_assistant_tokens = self.best_k

    def extra(self) -> dict[str, Any]:
        return {"num_assistant_tokens": self.best_k,
                "calibration_s": {str(k): round(v, 4) for k, v in self.calibration.items()}}


@register
class HeteroSpec(System):
    """This project's engine, in process: `Engine.generate(prompt_ids, temperature=0)`."""

    name = "hetero_spec"
    acceptance_keys = ("accepted", "drafted")
    runtime_overrides: dict[str, Any] = {}

    def setup(self, ctx: BenchContext) -> None:
        from .engine import Engine

        # ctx.config already holds the --set overrides and CPU_FP32
        self.engine = Engine.from_config(ctx.config, overrides=self.runtime_overrides or None)

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        out = self.engine.generate(prompt_ids, max_new_tokens=max_new, temperature=0.0)
        return RunOutput(out.token_ids, out.stats)

    def close(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.close()


@register
class HeteroSpecPipelined(HeteroSpec):
    """The engine with the draft in its own process (runtime.mode = two_process)."""

    name = "hetero_spec_pipelined"
    runtime_overrides = {"runtime.mode": "two_process"}

    @staticmethod
    def unavailable(ctx: BenchContext) -> str | None:
        from pydantic import ValidationError

        try:
            RuntimeConfig.model_validate({"mode": "two_process"})
        except ValidationError:
            return "this build's runtime.mode does not accept two_process yet"
        return None


# -- ONNX Runtime GenAI ---------------------------------------------------------------------------------
def _og():
    import onnxruntime_genai as og

    return og


def _no_ort_genai(ctx: BenchContext) -> str | None:
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return "onnxruntime-genai is not installed"
    return None


def _file_stamp(model_dir: Path) -> dict[str, Any]:
    """Identifies a checkpoint cheaply: weight file names, sizes and modification times."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
    return {"dir": str(model_dir.resolve()),
            "files": [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in files]}


def ort_target_dir(ctx: BenchContext) -> Path:
    """The target exported to ONNX under DIR/ort_models/target; reused while the checkpoint is unchanged."""
    from .draft.export import export_draft

    out = ctx.out / "ort_models" / "target"
    stamp_path = out / "hetero_spec_source.json"
    if ctx.ort_target is not None:  # given: link its files in (the draft goes inside, the original stays clean)
        out.mkdir(parents=True, exist_ok=True)
        for f in Path(ctx.ort_target).iterdir():
            if f.is_file():
                _place(f, out / f.name)
        stamp_path.unlink(missing_ok=True)
        return out
    stamp = _file_stamp(ctx.config.target.model)
    if (out / "model.onnx").is_file() and stamp_path.is_file() and json.loads(stamp_path.read_text()) == stamp:
        return out
    if out.exists():
        shutil.rmtree(out)
    log.info("exporting the target %s to ONNX under %s", ctx.config.target.model, out)
    export_draft(ctx.config.target.model, out, "fp32", quiet=True)
    stamp_path.write_text(json.dumps(stamp))
    return out


def _place(src: Path, dst: Path) -> None:
    """Hard-link (or copy, keeping the mtime) src to dst unless it is there already."""
    def stamp(p: Path) -> tuple[int, int]:
        return p.stat().st_size, p.stat().st_mtime_ns

    if dst.is_file() and stamp(dst) == stamp(src):
        return
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def ort_spec_overlay(target_dir: Path, draft_dir: Path, gamma: int, draft_threads: int) -> dict[str, Any]:
    """Put the ONNX draft inside the target's folder (target/draft/) and return the genai_config overlay.

    ORT GenAI refuses model paths outside the config's folder, so the draft's files are linked in with their
    original names (model.onnx references model.onnx.data by name). The overlay adds a `model.draft` decoder
    block (the draft's own decoder block, filename adjusted) and `speculative.max_draft_tokens`.
    It is also written next to genai_config.json as genai_config.spec.json, for reference.
    """
    sub = target_dir / "draft"
    sub.mkdir(exist_ok=True)
    for f in draft_dir.iterdir():
        if f.name.startswith("model.onnx"):  # model.onnx and its external data
            _place(f, sub / f.name)
    block = json.loads((draft_dir / "genai_config.json").read_text())["model"]["decoder"]
    block["filename"] = "draft/model.onnx"
    block.setdefault("session_options", {})["intra_op_num_threads"] = draft_threads
    overlay = {"model": {"draft": block}, "speculative": {"max_draft_tokens": gamma}}
    (target_dir / "genai_config.spec.json").write_text(json.dumps(overlay, indent=2))
    return overlay


class _OrtGenai(System):
    """Greedy decoding with `og.Generator`, one token per `generate_next_token` call."""

    def _load(self, folder: Path, overlay: dict[str, Any]) -> None:
        og = _og()
        cfg = og.Config(str(folder))
        cfg.overlay(json.dumps(overlay))
        self.model = og.Model(cfg)
        eos = json.loads((folder / "genai_config.json").read_text())["model"].get("eos_token_id", [])
        self.eos_ids = {int(e) for e in (eos if isinstance(eos, list) else [eos])}

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        og = _og()
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt_ids) + max_new, do_sample=False)
        gen = og.Generator(self.model, params)
        gen.append_tokens(prompt_ids)
        n0 = len(prompt_ids)
        while not gen.is_done() and gen.token_count() - n0 < max_new:
            gen.generate_next_token()
        ids = [int(t) for t in gen.get_sequence(0)[n0:n0 + max_new]]
        if gen.is_done() and len(ids) < max_new:
            # ORT GenAI stops on EOS without appending it to the sequence; transformers and hetero_spec
            # keep the stop token, so put it back for a like-for-like comparison.
            last = int(gen.get_next_tokens()[0])
            if last in self.eos_ids:
                ids.append(last)
        return RunOutput(ids, self._stats(gen))

    def _stats(self, gen) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        self.model = None


def _threads_overlay(threads: int) -> dict[str, Any]:
    return {"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}


@register
class OrtGenaiTargetOnly(_OrtGenai):
    """The target exported to ONNX (fp32), decoded alone by ONNX Runtime GenAI."""

    name = "ort_genai_target_only"
    unavailable = staticmethod(_no_ort_genai)

    def setup(self, ctx: BenchContext) -> None:
        self._load(ort_target_dir(ctx), _threads_overlay(ctx.torch_threads))


@register
class OrtGenaiSpec(_OrtGenai):
    """ONNX Runtime GenAI's own speculative decoding: the ONNX target with the config's ONNX draft."""

    name = "ort_genai_spec"
    acceptance_keys = ("draft_tokens_accepted", "draft_tokens_proposed")

    @staticmethod
    def unavailable(ctx: BenchContext) -> str | None:
        if reason := _no_ort_genai(ctx):
            return reason
        d = ctx.config.draft
        if d.kind != "onnx" or d.model is None or not (d.model / "genai_config.json").is_file():
            return "needs an ONNX draft exported by the model builder (draft.kind onnx, with genai_config.json)"
        return None

    def setup(self, ctx: BenchContext) -> None:
        target = ort_target_dir(ctx)
        overlay = ort_spec_overlay(target, ctx.config.draft.model, ctx.gamma, ctx.config.draft.threads)
        overlay["model"].update(_threads_overlay(ctx.torch_threads)["model"])
        self._load(target, overlay)

    def _stats(self, gen) -> dict[str, Any] | None:
        s = gen.get_speculative_stats()
        keep = ("rounds", "draft_tokens_proposed", "draft_tokens_accepted", "acceptance_rate",
                "total_draft_ms", "total_target_ms", "effective_k")
        return {k: s[k] for k in keep if k in s}


# -- prompts -------------------------------------------------------------------------------------------
def _corpus_module(config_path: Path):
    """models/corpus.py of this checkout (next to the package, or two levels above the config)."""
    for root in (Path(__file__).resolve().parents[1], config_path.resolve().parent.parent):
        path = root / "models" / "corpus.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location("hetero_spec_bench_corpus", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    return None


def _fallback_prompts(tokenizer, n: int, prompt_tokens: int) -> list[list[int]]:
    """Held-out standard-library files (same rule as models/corpus.py), one prompt cut from each."""
    import hashlib
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    prompts = []
    for p in files:
        rel = p.relative_to(root).as_posix()
        if hashlib.sha1(rel.encode()).digest()[0] >= 13:
            continue
        try:
            ids = tokenizer.encode(p.read_bytes().decode("utf-8"), add_special_tokens=False)
        except (UnicodeDecodeError, OSError):
            continue
        if len(ids) >= 2 * prompt_tokens:
            span = len(ids) - 2 * prompt_tokens + 1
            off = int.from_bytes(hashlib.sha1(rel.encode()).digest()[:4], "big") % span
            prompts.append(ids[off:off + prompt_tokens])
        if len(prompts) >= n:
            break
    return prompts


def heldout_prompt_ids(config: Config, config_path: Path, n: int, prompt_tokens: int) -> list[list[int]]:
    """n held-out prompts of prompt_tokens tokens each, tokenized with the target's tokenizer."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(config.target.model)
    except (OSError, ValueError) as exc:
        raise BenchError(f"the target {config.target.model} has no usable tokenizer for the held-out "
                         f"prompts: {exc}") from None
    corpus = _corpus_module(config_path)
    if corpus is not None and hasattr(corpus, "heldout_prompts"):
        prompts = corpus.heldout_prompts(tok, n=n, prompt_tokens=prompt_tokens, return_ids=True)
    else:
        prompts = _fallback_prompts(tok, n, prompt_tokens)
    if len(prompts) < n:
        raise BenchError(f"found only {len(prompts)} held-out prompts of {prompt_tokens} tokens; asked for {n}")
    return [[int(t) for t in p] for p in prompts]


# -- the run -------------------------------------------------------------------------------------------
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


def _resolve_systems(requested: list[str] | None) -> list[str]:
    if requested is None:
        return list(SYSTEMS)
    unknown = [s for s in requested if s not in SYSTEMS]
    if unknown:
        raise BenchError(f"--systems: unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    chosen = set(requested) | {"target_only"}  # every speedup and identity is measured against it
    return [s for s in SYSTEMS if s in chosen]


def _start_systems(ctx: BenchContext, names: list[str], baseline: ProcState
                   ) -> tuple[dict[str, tuple[System, ProcState]], dict[str, SystemResult]]:
    """Check, set up and warm up each system (untimed); failures become a status, not a crash.

    Each setup starts from the baseline process state; the state a system leaves is restored before its runs.
    """
    live: dict[str, tuple[System, ProcState]] = {}
    results = {n: SystemResult(n) for n in names}
    warm_prompt = ctx.prompts[0]
    for name in names:
        cls, res = SYSTEMS[name], results[name]
        if reason := cls.unavailable(ctx):
            res.status, res.reason = "skipped", reason
            continue
        system = cls()
        try:
            log.info("setting up %s", name)
            baseline.apply()
            t = time.perf_counter()
            system.setup(ctx)
            res.extra["setup_s"] = round(time.perf_counter() - t, 3)
            t = time.perf_counter()
            system.run(warm_prompt, min(WARMUP_TOKENS, ctx.max_new))
            res.extra["warmup_s"] = round(time.perf_counter() - t, 3)
        except Exception as exc:  # any engine's failure is reported, the others still run
            if name == "target_only":
                raise BenchError(f"the target_only baseline failed: {type(exc).__name__}: {exc}") from exc
            res.status, res.reason = "unavailable", f"{type(exc).__name__}: {exc}"
            log.warning("%s unavailable: %s", name, res.reason)
            _close(system)
            continue
        state = ProcState.capture()
        res.extra.update(cpus=sorted(state.cpus) if state.cpus is not None else None, torch_threads=state.threads)
        live[name] = (system, state)
    baseline.apply()
    return live, results


def _close(system: System) -> None:
    try:
        system.close()
    except Exception as exc:  # closing must never hide the results
        log.warning("closing %s: %s", system.name, exc)


def _interleave(ctx: BenchContext, live: dict[str, tuple[System, ProcState]],
                results: dict[str, SystemResult]) -> None:
    """Per prompt, each live system once, in registry order, each in the process state it set up."""
    from tqdm import tqdm

    bar = tqdm(total=len(ctx.prompts) * len(live), desc="bench", unit="run", file=sys.stderr,
               dynamic_ncols=True)
    try:
        for i, prompt in enumerate(ctx.prompts):
            for name in list(live):
                bar.set_postfix_str(f"prompt {i + 1}/{len(ctx.prompts)} {name}")
                system, state = live[name]
                state.apply()
                t = time.perf_counter()
                try:
                    out = system.run(prompt, ctx.max_new)
                except Exception as exc:
                    if name == "target_only":
                        raise BenchError(f"target_only failed on prompt {i}: {exc}") from exc
                    res = results[name]
                    res.status, res.reason = "failed", f"prompt {i}: {type(exc).__name__}: {exc}"
                    _close(live.pop(name)[0])
                    continue
                wall = time.perf_counter() - t
                results[name].runs.append({"wall_s": wall, "token_ids": out.token_ids, "stats": out.stats})
                bar.update(1)
    finally:
        bar.close()


def run_bench(settings: BenchSettings, prompt_ids: list[list[int]] | None = None) -> dict[str, Any]:
    """Run the benchmark and write bench.json, bench.md and bench.png under settings.out.

    prompt_ids replaces the held-out prompts (tests use it with tiny models). Returns the bench.json dict.
    """
    config = load_config(settings.config, overrides={**settings.overrides, **CPU_FP32})
    check_paths(config)
    names = _resolve_systems(settings.systems)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    draft_hf = settings.draft_hf if settings.draft_hf is not None else default_draft_hf(settings.config)
    t = time.perf_counter()
    if prompt_ids is None:
        prompt_ids = heldout_prompt_ids(config, settings.config, settings.n_prompts, settings.prompt_tokens)
    log.info("%d prompts ready in %.1f s", len(prompt_ids), time.perf_counter() - t)
    prompts = [list(p) for p in prompt_ids[:settings.n_prompts]]
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
                       ort_target=settings.ort_target)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # generate() warns per call about generation_config defaults
    live: dict[str, tuple[System, ProcState]] = {}
    try:
        live, results = _start_systems(ctx, names, ProcState(original.cpus, threads))
        _interleave(ctx, live, results)
    finally:
        for name, (system, _) in live.items():
            results[name].extra.update(system.extra())
            _close(system)
        original.apply()
        hf_logging.set_verbosity(verbosity)
    report = build_report(settings, ctx, results)
    write_outputs(out, report)
    return report


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


# -- summaries -----------------------------------------------------------------------------------------
def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _acceptance(name: str, runs: list[dict[str, Any]]) -> float | None:
    """Per-token acceptance over all prompts: accepted draft tokens / drafted tokens."""
    keys = SYSTEMS[name].acceptance_keys if name in SYSTEMS else None
    if keys is None or not runs or any(r["stats"] is None for r in runs):
        return None
    acc = sum(r["stats"].get(keys[0], 0) for r in runs)
    drafted = sum(r["stats"].get(keys[1], 0) for r in runs)
    return acc / drafted if drafted else None


def summarize(res: SystemResult, ref: SystemResult, ort_ref: SystemResult | None) -> dict[str, Any]:
    """One system's bench.json entry; per-prompt ratios are taken against the same prompt's reference."""
    entry: dict[str, Any] = {"name": res.name, "status": res.status, "reason": res.reason,
                             "tokens_per_s": None, "speedup_vs_target_only": None, "acceptance_rate": None,
                             "identical_to_target_only": None, "per_prompt": [], "extra": res.extra}
    if res.name.startswith("ort_genai"):
        entry["identical_to_ort_genai_target_only"] = None
    complete = res.status == "ok" and len(res.runs) == len(ref.runs)
    if not complete:
        return entry
    for run, base in zip(res.runs, ref.runs):
        n = len(run["token_ids"])
        entry["per_prompt"].append({
            "wall_s": round(run["wall_s"], 6), "new_tokens": n,
            "tokens_per_s": round(n / run["wall_s"], 3) if run["wall_s"] > 0 else None,
            "speedup_vs_target_only": round(base["wall_s"] / run["wall_s"], 4),
            "identical_to_target_only": run["token_ids"] == base["token_ids"],
            "stats": run["stats"]})
    pp = entry["per_prompt"]
    entry["tokens_per_s"] = _median([p["tokens_per_s"] for p in pp if p["tokens_per_s"] is not None])
    entry["speedup_vs_target_only"] = _median([p["speedup_vs_target_only"] for p in pp])
    entry["acceptance_rate"] = _acceptance(res.name, res.runs)
    entry["identical_to_target_only"] = all(p["identical_to_target_only"] for p in pp)
    if "identical_to_ort_genai_target_only" in entry and ort_ref is not None and ort_ref.status == "ok" \
            and len(ort_ref.runs) == len(res.runs):
        entry["identical_to_ort_genai_target_only"] = all(
            a["token_ids"] == b["token_ids"] for a, b in zip(res.runs, ort_ref.runs))
    return entry


def analytic(entries: dict[str, dict[str, Any]], results: dict[str, SystemResult], gamma: int) -> dict[str, Any]:
    """Expected speedup of hetero_spec from its own measured acceptance and stage costs.

    With per-token acceptance a and gamma g, a round yields E = (1 - a^(g+1)) / (1 - a) tokens; it costs
    g draft steps plus one verify block, against E target steps without speculation:
        predicted = E * t_target_step / (g * t_draft_token + t_verify_block).
    t_target_step is target_only's wall time per generated token (prefill included), summed over prompts.
    """
    hs, ref = results.get("hetero_spec"), results["target_only"]
    entry = entries.get("hetero_spec")
    if hs is None or entry is None or entry["status"] != "ok" or not hs.runs:
        return {"available": False, "reason": "hetero_spec did not run"}
    tot = {k: sum(r["stats"][k] for r in hs.runs) for k in ("drafted", "accepted", "rounds",
                                                            "time_draft_s", "time_verify_s")}
    if not tot["drafted"] or not tot["rounds"]:
        return {"available": False, "reason": "hetero_spec drafted no tokens (no proposer?)"}
    # per-token acceptance: every round is a run of accepted tokens ended by a rejection, unless the
    # whole block was accepted; accepted/drafted would undercount (tokens after a rejection are never
    # tested). Rounds with full acceptance are those whose accepted count equals what was drafted.
    rejections = sum(sum(c for n, c in enumerate(r["stats"]["accept_hist"]) if n < gamma) for r in hs.runs)
    a, g = tot["accepted"] / max(1, tot["accepted"] + rejections), gamma
    e = (g + 1.0) if a >= 1.0 else (1 - a ** (g + 1)) / (1 - a)
    t_draft = tot["time_draft_s"] / tot["drafted"]
    t_verify = tot["time_verify_s"] / tot["rounds"]
    t_target = sum(r["wall_s"] for r in ref.runs) / max(1, sum(len(r["token_ids"]) for r in ref.runs))
    predicted = e * t_target / (g * t_draft + t_verify)
    measured = entry["speedup_vs_target_only"]
    return {"available": True, "acceptance_rate": tot["accepted"] / tot["drafted"],
            "per_token_acceptance": a, "gamma": g, "expected_tokens_per_round": e,
            "t_target_step_s": t_target, "t_draft_token_s": t_draft, "t_verify_block_s": t_verify,
            "predicted_speedup": predicted, "measured_speedup": measured,
            "efficiency": measured / predicted if predicted else None,
            "formula": "E = (1 - a^(g+1)) / (1 - a); predicted = E * t_target_step / "
                       "(g * t_draft_token + t_verify_block)"}


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "onnxruntime", "onnxruntime-genai", "hetero-spec"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _machine() -> dict[str, Any]:
    model = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "cpu_model": model}


def command_line(settings: BenchSettings) -> str:
    parts = ["hetero-spec", "bench", "--config", str(settings.config), "--out", str(settings.out),
             "--prompts", str(settings.n_prompts), "--max-new-tokens", str(settings.max_new)]
    if settings.systems:
        parts += ["--systems", ",".join(settings.systems)]
    if settings.quick:
        parts.append("--quick")
    if settings.prompt_tokens != DEFAULT_PROMPT_TOKENS:
        parts += ["--prompt-tokens", str(settings.prompt_tokens)]
    if settings.draft_hf is not None:
        parts += ["--draft-hf", str(settings.draft_hf)]
    if settings.ort_target is not None:
        parts += ["--ort-target", str(settings.ort_target)]
    for k, v in settings.overrides.items():
        parts += ["--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    return shlex.join(parts)


def build_report(settings: BenchSettings, ctx: BenchContext, results: dict[str, SystemResult]) -> dict[str, Any]:
    ref = results["target_only"]
    ort_ref = results.get("ort_genai_target_only")
    entries = {n: summarize(r, ref, ort_ref if n != "ort_genai_target_only" else None)
               for n, r in results.items()}
    return {
        "machine": _machine(),
        "versions": _versions(),
        "config": {"source": ctx.config.source, **ctx.config.model_dump(mode="json")},
        "settings": {"prompts": len(ctx.prompts), "max_new_tokens": ctx.max_new, "gamma": ctx.gamma,
                     "prompt_tokens": [len(p) for p in ctx.prompts], "quick": settings.quick,
                     "overrides": ctx.overrides, "torch_threads": ctx.torch_threads,
                     "draft_hf": str(ctx.draft_hf) if ctx.draft_hf else None,
                     "order": "interleaved per prompt, registry order; one untimed warm-up per system",
                     "command": command_line(settings)},
        "systems": list(entries.values()),
        "analytic": analytic(entries, results, ctx.gamma),
        "pipelined_vs_in_process": pipelined_vs_in_process(entries),
    }


def pipelined_vs_in_process(entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The two-process runtime against the in-process engine, prompt by prompt (same prompts, same
    interleaved pass): median of in-process wall time / two-process wall time, and how many prompts
    the two-process runtime was faster on."""
    a, b = entries.get("hetero_spec"), entries.get("hetero_spec_pipelined")
    if not a or not b or not a["per_prompt"] or len(a["per_prompt"]) != len(b["per_prompt"]):
        return {"available": False}
    ratios = [x["wall_s"] / y["wall_s"] for x, y in zip(a["per_prompt"], b["per_prompt"]) if y["wall_s"] > 0]
    return {"available": True, "median_speedup": round(_median(ratios), 4),
            "prompts_faster": sum(r > 1.0 for r in ratios), "prompts": len(ratios)}


# -- outputs -------------------------------------------------------------------------------------------
def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = ["# hetero-spec bench", "",
             f"`{s['command']}`", "",
             f"{s['prompts']} held-out prompts x {s['max_new_tokens']} new tokens, greedy, gamma {s['gamma']}, "
             f"torch threads {s['torch_threads']}, {report['machine']['cpu_count']} CPUs "
             f"({report['machine']['cpu_model']}); {s['order']}.", "",
             "| system | tok/s | speedup vs target_only | acceptance | identical | status |",
             "|---|---:|---:|---:|:---:|---|"]
    for e in report["systems"]:
        ident = {True: "yes", False: "**no**", None: "-"}[e["identical_to_target_only"]]
        status = e["status"] if e["status"] == "ok" else f"{e['status']}: {e['reason']}"
        lines.append(f"| {e['name']} | {_fmt(e['tokens_per_s'], '.1f')} | "
                     f"{_fmt(e['speedup_vs_target_only'], '.2f')}x | {_fmt(e['acceptance_rate'], '.3f')} | "
                     f"{ident} | {status} |")
    a = report["analytic"]
    lines.append("")
    if a.get("available"):
        lines.append(f"Analytic expectation for hetero_spec: per-token acceptance a = "
                     f"{a['per_token_acceptance']:.3f} (accepted/drafted {a['acceptance_rate']:.3f}), "
                     f"E = {a['expected_tokens_per_round']:.2f} tokens/round, predicted "
                     f"{a['predicted_speedup']:.2f}x, measured {_fmt(a['measured_speedup'], '.2f')}x, "
                     f"efficiency {_fmt(a['efficiency'], '.2f')} ({a['formula']}).")
    else:
        lines.append(f"Analytic expectation: not available ({a.get('reason')}).")
    pv = report.get("pipelined_vs_in_process", {})
    if pv.get("available"):
        lines.append("")
        lines.append(f"hetero_spec_pipelined vs hetero_spec (in-process), per prompt: median "
                     f"{pv['median_speedup']:.3f}x, faster on {pv['prompts_faster']} of {pv['prompts']} prompts.")
    return "\n".join(lines) + "\n"


def render_plot(report: dict[str, Any], path: Path) -> None:
    """Bars: median per-prompt speedup vs target_only; error bars span min to max."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [(e["name"], [p["speedup_vs_target_only"] for p in e["per_prompt"]])
            for e in report["systems"] if e["per_prompt"]]
    fig = Figure(figsize=(max(5.0, 1.3 * len(rows) + 1.5), 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    med = [statistics.median(v) for _, v in rows]
    lo = [m - min(v) for m, (_, v) in zip(med, rows)]
    hi = [max(v) - m for m, (_, v) in zip(med, rows)]
    colors = ["#888888" if n == "target_only" else "#2a7ab9" if n.startswith("hetero_spec") else "#e0a030"
              for n, _ in rows]
    ax.bar(range(len(rows)), med, yerr=[lo, hi], capsize=4, color=colors)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(rows)), [n for n, _ in rows], rotation=25, ha="right")
    ax.set_ylabel("speedup vs target_only (per prompt)")
    s = report["settings"]
    ax.set_title(f"{s['prompts']} prompts x {s['max_new_tokens']} tokens, greedy (median, min-max)")
    for x, (m, (_, v)) in enumerate(zip(med, rows)):  # above the error bar, not on it
        ax.annotate(f"{m:.2f}x", (x, max(v)), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    fig.savefig(path, dpi=120)


def write_outputs(out: Path, report: dict[str, Any]) -> None:
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench.md").write_text(render_markdown(report))
    render_plot(report, out / "bench.png")


# -- command line --------------------------------------------------------------------------------------
def settings_from_args(args) -> BenchSettings:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else None
    for name, val in (("--prompts", args.prompts), ("--max-new-tokens", args.max_new_tokens),
                      ("--prompt-tokens", args.prompt_tokens)):
        if val is not None and val < 1:
            raise BenchError(f"{name} must be >= 1, got {val}")
    return BenchSettings(config=Path(args.config), out=Path(args.out), prompts=args.prompts,
                         max_new_tokens=args.max_new_tokens, systems=systems, quick=args.quick,
                         overrides=dict(parse_override(p) for p in args.overrides),
                         draft_hf=Path(args.draft_hf) if args.draft_hf else None,
                         prompt_tokens=args.prompt_tokens or DEFAULT_PROMPT_TOKENS,
                         ort_target=Path(args.ort_target) if args.ort_target else None)


def run_bench_cli(args) -> int:
    settings = settings_from_args(args)
    t = time.perf_counter()
    report = run_bench(settings)
    print(render_markdown(report), end="")
    print(f"[bench: {time.perf_counter() - t:.0f} s; wrote {settings.out / 'bench.json'}, bench.md, bench.png]",
          file=sys.stderr)
    return 0
