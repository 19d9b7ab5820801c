"""`hetero-spec bench --precision-matrix`: draft precision x target precision x KV dtype, in one run.

For every combination this machine supports of draft precision (fp32, int8, int4), target precision
(`target.precision`: fp32, int8, int4; the onnx backend's export at that precision) and KV-cache dtype (only
`auto` exists today, fp32 in every CPU export), each heterogeneous arm is measured in the layouts asked for
(default: the shipped auto placement, `runtime.mode: auto` + `runtime.cpus: auto`, and two_process with one
target and one draft thread, pinned). Per arm: acceptance (accepted / drafted from Engine stats), draft ms per
token (stats time_draft_s / drafted in process; the worker-measured estimate of the gate in two_process, where
drafting is off the target's clock), verify ms per round (time_verify_s / rounds), on-disk weights of the
target and draft exports (model.onnx + model.onnx.data), the target's KV bytes per token (2 x layers x kv_heads
x head_dim x element size, from the export's genai_config.json and its KV input dtype) and at 1k / 8k context,
the speedup over the target alone at the same precision (throughput ratio paired per prompt, median over
prompts), and identity with it ("n/N" prompts with the same greedy output; a quantized target's own output is
the reference, so rounding cannot make an arm differ from it, but it is counted, never asserted).

The drafts: the shipped exports beside the Hugging Face draft (models/draft-onnx-fp32, -int4), and the
Hugging Face draft with `draft.precision` where no export exists (int8: exported once into the cache).

Peers at the same target precision (same export, same prompts, same pass): ONNX Runtime GenAI's speculative
decoding with the config's draft at 1 core and at all cores, and its target alone at all cores (the
`hetero-spec bench` systems of ort_genai.py, gamma calibrated over --gammas on the warm-up prompts).

One pass per target precision: its engines start (and warm up, untimed) together, the arms run interleaved per
prompt with rotating order, a prompt's time is the median of its repeats, and every arm is paired per prompt
with the target alone (tuning_bench's helpers). Headline figures for the int8 target: (a) the best
heterogeneous layout with the shipped draft against ORT GenAI speculative on one core (goal >= 1.25x), (b) the
shipped recommendation (configs as shipped, target.precision int8) against the int8 target alone on all cores
(goal >= 0.97x), with its identity count.

Outputs: OUT/precision.json, OUT/precision.md, OUT/precision.png.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .context import CPU_FP32, BenchContext, BenchError, RunOutput
from .tuning_bench import (TARGET_ONLY, Arm, EngineRunner, PromptSet, Say, Scenario, _check_context,
                           _prompt_sources, input_flags, pair_arms, say_stderr, target_only_overrides)

PRECISIONS = ("fp32", "int8", "int4")
LAYOUTS = ("auto", "two_process", "in_process")
DEFAULT_LAYOUTS = ("auto", "two_process")
KV_DTYPES = ("auto",)  # the only KV-cache setting today: the export's own dtype (fp32 on the CPU provider)
PEERS = {  # arm name -> bench system (ort_genai.py)
    "ort_genai_spec 1 core": "ort_genai_spec",
    "ort_genai_spec all cores": "ort_genai_spec_all_cores",
    "ort_genai_target_only all cores": "ort_genai_target_only_all_cores",
}
ORT_SPEC_1CORE = "ort_genai_spec 1 core"
DEFAULT_GAMMAS = (4, 6, 8, 10, 12)  # ORT GenAI's max_draft_tokens candidates (as `hetero-spec bench`)
WARMUP_PROMPTS = 2
HEADLINE_TARGET = "int8"
GOAL_VS_ORT = 1.25  # (a) best heterogeneous layout / ORT GenAI speculative on one core
GOAL_SHIPPED = 0.97  # (b) shipped recommendation / the target alone on all cores
KV_CONTEXTS = (1024, 8192)
SYSTEM = "__bench_system__"  # an engine spec with this key names a bench system instead of Engine overrides
MB = 1e6


# -- settings --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftSource:
    """Where a draft precision comes from: an export (precision None: it has its own), or a Hugging Face
    checkpoint exported at `precision` on first use (draft.precision). reason: why it cannot run here."""

    model: Path | None
    precision: str | None = None
    reason: str | None = None

    def overrides(self) -> dict[str, Any]:
        return {"draft.kind": "onnx", "draft.model": str(self.model), "draft.precision": self.precision,
                "draft.candidates": []}


@dataclass
class PrecisionSettings:
    """What to run. None means the default (6 prompts x 96 tokens x 2 repeats; 3 x 48 x 1 with quick)."""

    config: Path
    out: Path
    prompts: int | None = None
    max_new_tokens: int | None = None
    repeats: int | None = None
    quick: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 128
    prompts_file: Path | None = None
    draft_hf: Path | None = None
    target_precisions: tuple[str, ...] = PRECISIONS
    draft_precisions: tuple[str, ...] = PRECISIONS
    layouts: tuple[str, ...] = DEFAULT_LAYOUTS
    peers: tuple[str, ...] = tuple(PEERS)
    gammas: tuple[int, ...] | None = DEFAULT_GAMMAS
    drafts: dict[str, DraftSource] | None = None
    """Draft sources by precision label (tests); None: found beside the Hugging Face draft (draft_sources)."""
    prompt_ids: list[list[int]] | None = None
    """Token-id prompts instead of the held-out ones (tests); the first ones also warm up."""

    @property
    def n_prompts(self) -> int:
        return self.prompts or (3 if self.quick else 6)

    @property
    def max_new(self) -> int:
        return self.max_new_tokens or (48 if self.quick else 96)

    @property
    def n_repeats(self) -> int:
        return self.repeats or (1 if self.quick else 2)


def parse_matrix(value: str | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`--precision-matrix [TARGETS[/DRAFTS]]` -> (target precisions, draft precisions); 'all' or nothing: all."""
    if value is None or value.strip() in ("", "all"):
        return PRECISIONS, PRECISIONS
    parts = value.split("/")
    if len(parts) > 2:
        raise BenchError(f"--precision-matrix {value!r}: expected TARGETS[/DRAFTS], e.g. int8 or fp32,int8/int4")

    def names(text: str, what: str) -> tuple[str, ...]:
        got = [v.strip() for v in text.split(",") if v.strip()]
        if not got or text.strip() == "all":
            return PRECISIONS
        bad = [v for v in got if v not in PRECISIONS]
        if bad:
            raise BenchError(f"--precision-matrix {value!r}: {what} precision {bad[0]!r} is not one of "
                             f"{', '.join(PRECISIONS)}")
        return tuple(p for p in PRECISIONS if p in got)

    return names(parts[0], "target"), names(parts[1], "draft") if len(parts) == 2 else PRECISIONS


def parse_layouts(value: str | None) -> tuple[str, ...]:
    if value is None:
        return DEFAULT_LAYOUTS
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in LAYOUTS]
    if bad or not names:
        raise BenchError(f"--layouts {value!r}: with --precision-matrix each must be one of {', '.join(LAYOUTS)}")
    return tuple(dict.fromkeys(names))


def parse_peers(value: str | None) -> tuple[str, ...]:
    """--systems with --precision-matrix: 'none', or a comma list of the ORT GenAI peers (system names)."""
    if value is None:
        return tuple(PEERS)
    if value.strip() == "none":
        return ()
    by_system = {v: k for k, v in PEERS.items()}
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in by_system]
    if bad or not names:
        raise BenchError(f"--systems {value!r}: with --precision-matrix, 'none' or a comma list of "
                         f"{', '.join(by_system)}")
    return tuple(by_system[n] for n in by_system if n in names)


def draft_sources(config, config_path: Path, draft_hf: Path | None,
                  precisions: Sequence[str]) -> dict[str, DraftSource]:
    """Per draft precision: the shipped export beside the Hugging Face draft (DIR-onnx-PRECISION), else that
    checkpoint with draft.precision (exported once into the cache), else why not."""
    from .run import default_draft_hf

    hf = Path(draft_hf).resolve() if draft_hf else default_draft_hf(config_path)
    cfg_draft = Path(config.draft.model).resolve() if config.draft.kind == "onnx" and config.draft.model else None
    out: dict[str, DraftSource] = {}
    for p in precisions:
        exports = []
        if hf is not None:
            exports.append(hf.parent / f"{hf.name}-onnx-{p}")
        if cfg_draft is not None and cfg_draft.name.endswith(("-fp32", "-int8", "-int4")):
            exports.append(cfg_draft.parent / f"{cfg_draft.name.rsplit('-', 1)[0]}-{p}")
        found = next((e for e in exports if (e / "model.onnx").is_file()), None)
        if found is not None:
            out[p] = DraftSource(found.resolve())
        elif hf is not None and (hf / "config.json").is_file():
            out[p] = DraftSource(hf, p)
        else:
            out[p] = DraftSource(None, reason=f"no {p} draft export and no Hugging Face draft to export (--draft-hf)")
    return out


def layout_overrides(layout: str, n_cores: int) -> dict[str, Any]:
    """auto: the shipped placement by measurement; two_process: 1 target + 1 draft thread on disjoint cores;
    in_process: the target on every core, the draft on one, in turn."""
    if layout == "auto":
        return {"runtime.mode": "auto", "runtime.cpus": "auto"}
    if layout == "two_process":
        return {"runtime.mode": "two_process", "runtime.cpus": None, "runtime.pin_cpus": True,
                "target.threads": 1, "draft.threads": 1}
    return {"runtime.mode": "in_process", "runtime.cpus": None, "target.threads": n_cores, "draft.threads": 1}


def arm_name(draft: str, layout: str) -> str:
    return f"draft {draft} / {layout}"


# -- engines and systems -----------------------------------------------------------------------------
class _SystemEngine:
    """A bench system (setup/run/close) behind the slice of the Engine interface EngineRunner uses."""

    config = None

    def __init__(self, system, ctx: BenchContext):
        self.system, self.ctx = system, ctx

    def generate(self, prompt: list[int], max_new_tokens: int, **_: Any):
        out = self.system.run(prompt, max_new_tokens)
        return RunOutput(out.token_ids, ort_stats(out.stats))

    def close(self) -> None:
        self.system.close()


def ort_stats(s: dict[str, Any] | None) -> dict[str, Any] | None:
    """ORT GenAI's speculative stats in the Engine's names (drafted, accepted, rounds, time_*_s)."""
    if not s:
        return None
    return {"drafted": s.get("draft_tokens_proposed", 0), "accepted": s.get("draft_tokens_accepted", 0),
            "rounds": s.get("rounds", 0), "time_draft_s": s.get("total_draft_ms", 0.0) / 1e3,
            "time_verify_s": s.get("total_target_ms", 0.0) / 1e3, "ort_genai": s}


class PrecisionRunner(EngineRunner):
    """EngineRunner whose engine specs may also name a bench system (the ORT GenAI peers). Each engine's
    process state (affinity, threads) is captured again after each of its runs: an auto placement that
    switches layout between requests leaves a new state, which its next run must get."""

    def __init__(self, config: Path, base: dict[str, Any], engines: dict[str, dict[str, Any]],
                 warmup: Sequence[list[int]], max_new: int, say: Say, out: Path,
                 gammas: tuple[int, ...] | None):
        self._out, self._gammas, self._contexts = out, gammas, {}
        super().__init__(config, base, engines, warmup, max_new, say)

    def _start(self, name: str, config: Path, overrides: dict[str, Any], warmup: Sequence[list[int]]) -> None:
        system_name = overrides.get(SYSTEM)
        if system_name is None:
            super()._start(name, config, overrides, warmup)
            return
        from ..config import load_config
        from .systems import SYSTEMS, cores

        try:
            from ..precision import resolve_draft

            # the pass's draft (draft.model, draft.precision): an HF checkpoint becomes its cached export here
            cfg = resolve_draft(load_config(config, overrides={k: v for k, v in overrides.items() if k != SYSTEM}))
            ctx = BenchContext(config=cfg, overrides={}, out=self._out, draft_hf=None,
                               prompts=[list(p) for p in warmup], max_new=self.max_new, torch_threads=cores(),
                               gammas=self._gammas)
            cls = SYSTEMS[system_name]
            if reason := cls.unavailable(ctx):
                self.unavailable[name] = reason
                return
            system = cls()
            engine = _SystemEngine(system, ctx)
            try:
                system.setup(ctx)  # ORT GenAI speculative: max_draft_tokens calibrated on the warm-up prompts
                for p in warmup:
                    engine.generate(p, self.max_new)
            except BaseException:
                system.close()
                raise
        except Exception as exc:
            self.unavailable[name] = f"{type(exc).__name__}: {exc}"
            return
        self._contexts[name] = ctx
        self._engines[name] = (engine, None)

    def run(self, arm: Arm, prompt: list[int]) -> RunOutput:
        from .run import ProcState

        out = super().run(arm, prompt)
        engine, _ = self._engines[arm.engine]
        self._engines[arm.engine] = (engine, ProcState.capture())
        return out

    def describe(self, name: str) -> dict[str, Any] | None:
        if name not in self._engines:
            return None
        engine = self._engines[name][0]
        if isinstance(engine, _SystemEngine):
            return {**engine.system.describe(engine.ctx), **engine.system.extra(),
                    "target_dir": str(_ort_dir(engine.ctx))}
        c = engine.config
        plan = getattr(engine, "_cpu_plan", None)
        out = {"backend": c.target.backend, "precision": c.target.precision, "layout": c.runtime.mode,
               "target_threads": plan.threads if plan is not None else c.target.threads,
               "draft_threads": c.draft.threads if c.draft.kind == "onnx" else None,
               "draft_model": str(c.draft.model) if c.draft.kind == "onnx" else None,
               "gamma": c.speculation.gamma, "target_dir": _target_dir(c)}
        placement = getattr(engine, "placement", None) or {}
        if placement.get("chosen"):
            from ..tuning.placement import Layout

            out["placement"] = {"chosen": Layout(**placement["chosen"]).label(),
                                "switches": len(placement.get("switches") or [])}
        return out


def _ort_dir(ctx: BenchContext) -> Path:
    from .ort_genai import ort_target_dir

    return ort_target_dir(ctx)


def _target_dir(c) -> str | None:
    """The ONNX directory the onnx backend loaded (the cached export at target.precision)."""
    if c.target.backend != "onnx":
        return None
    from ..target.backends import onnx_model_dir

    return str(onnx_model_dir(c.target))


def peer_draft(drafts: dict[str, DraftSource], shipped: str | None) -> str | None:
    """The draft the ORT GenAI peers of a pass run: the shipped one when the pass measures it, else the pass's
    first available draft (a pass of int4 drafts only: the int4 draft, not the config's)."""
    ok = [d for d, src in drafts.items() if src.model is not None]
    return shipped if shipped in ok else (ok[0] if ok else None)


def pass_engines(target_precision: str, drafts: dict[str, DraftSource], layouts: Sequence[str],
                 peers: Sequence[str], n_cores: int, shipped: str | None = None
                 ) -> tuple[dict[str, dict[str, Any]], list[Arm]]:
    """One target precision's engines: the target alone on every core, every available draft in every layout
    (gamma auto), and the ORT GenAI peers with the pass's draft (peer_draft). target.precision itself comes
    with the pass's base overrides."""
    engines: dict[str, dict[str, Any]] = {
        TARGET_ONLY: {**target_only_overrides(), "runtime.cpus": None, "target.threads": n_cores}}
    for d, src in drafts.items():
        if src.model is None:
            continue
        for layout in layouts:
            engines[arm_name(d, layout)] = {**src.overrides(), **layout_overrides(layout, n_cores),
                                            "speculation.gamma": "auto"}
    own = peer_draft(drafts, shipped)
    for peer in peers:
        draft = drafts[own].overrides() if own is not None and PEERS[peer] != "ort_genai_target_only_all_cores" \
            else {}
        engines[peer] = {SYSTEM: PEERS[peer], **draft}
    return engines, [Arm(name, name) for name in engines]


# -- measures ------------------------------------------------------------------------------------------
def weights_mb(model_dir: str | Path | None) -> float | None:
    """On-disk weights of an ONNX export: model.onnx + model.onnx.data, in MB (10^6 bytes)."""
    if model_dir is None or not (Path(model_dir) / "model.onnx").is_file():
        return None
    d = Path(model_dir)
    return round(sum((d / f).stat().st_size for f in ("model.onnx", "model.onnx.data") if (d / f).is_file()) / MB, 3)


def kv_cache(model_dir: str | Path | None) -> dict[str, Any] | None:
    """The export's KV cache per token: 2 (K and V) x layers x kv_heads x head_dim x element size, from
    genai_config.json `model.decoder` and the dtype of its first past-key input; also at 1k and 8k context."""
    if model_dir is None or not (Path(model_dir) / "genai_config.json").is_file():
        return None
    dec = json.loads((Path(model_dir) / "genai_config.json").read_text())["model"]["decoder"]
    layers, heads = int(dec["num_hidden_layers"]), int(dec.get("num_key_value_heads") or dec["num_attention_heads"])
    head_dim = int(dec.get("head_size") or dec["hidden_size"] // dec["num_attention_heads"])
    dtype, size = _kv_dtype(Path(model_dir), dec)
    per_token = 2 * layers * heads * head_dim * size
    return {"layers": layers, "kv_heads": heads, "head_dim": head_dim, "dtype": dtype, "element_bytes": size,
            "bytes_per_token": per_token,
            "mb_at": {str(n): round(per_token * n / MB, 3) for n in KV_CONTEXTS}}


def _kv_dtype(model_dir: Path, decoder: dict[str, Any]) -> tuple[str, int]:
    """(dtype name, bytes per element) of the export's KV inputs; fp32 when it cannot be read."""
    try:
        import numpy as np
        import onnx

        key = (decoder.get("inputs") or {}).get("past_key_names", "past_key_values.%d.key") % 0
        graph = onnx.load(str(model_dir / "model.onnx"), load_external_data=False).graph
        elem = next(i.type.tensor_type.elem_type for i in graph.input if i.name == key)
        np_dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
        names = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
        return names.get(np_dtype.name, np_dtype.name), np_dtype.itemsize
    except Exception:  # no onnx package, or an unusual graph: the CPU builder's KV is fp32
        return "fp32", 4


def stat_sums(samples) -> dict[str, float]:
    """drafted, accepted, rounds, time_draft_s, time_verify_s summed over prompts (first repeat's stats)."""
    keys = ("drafted", "accepted", "rounds", "time_draft_s", "time_verify_s")
    stats = [s.stats for s in samples if s.stats]
    return {k: sum(float(st.get(k) or 0) for st in stats) for k in keys}


def draft_ms_per_token(samples) -> tuple[float | None, str | None]:
    """Drafting time per drafted token: stats time_draft_s / drafted (in process: on the request's clock);
    in two_process drafting runs in the worker, off that clock: the gate's worker-measured estimate (median
    over prompts)."""
    s = stat_sums(samples)
    if s["drafted"] and s["time_draft_s"] > 0:
        return round(s["time_draft_s"] / s["drafted"] * 1e3, 3), "time_draft_s / drafted"
    gate = [g["draft_ms_per_token"] for x in samples
            if (g := ((x.stats or {}).get("extra") or {}).get("gate")) and g.get("draft_ms_per_token") is not None]
    if gate:
        return round(statistics.median(gate), 3), "worker-measured (gate estimate)"
    return None, None


def tokens_per_s(samples) -> float | None:
    """Median over prompts of new tokens / wall time (a prompt's time: the median of its repeats)."""
    rates = [len(x.token_ids) / x.wall_s for x in samples if x.wall_s > 0]
    return round(statistics.median(rates), 2) if rates else None


def arm_measures(samples) -> dict[str, Any]:
    """Acceptance, draft and verify costs from the Engine stats of each prompt's first repeat; drafting_prompts:
    on how many prompts anything was drafted (none: the cost gate kept speculation off, the target decoded
    alone)."""
    s = stat_sums(samples)
    dms, source = draft_ms_per_token(samples)
    drafting = sum(bool((x.stats or {}).get("drafted")) for x in samples)
    return {"drafted": int(s["drafted"]), "accepted": int(s["accepted"]), "rounds": int(s["rounds"]),
            "drafting_prompts": f"{drafting}/{len(samples)}", "tokens_per_s": tokens_per_s(samples),
            "acceptance": round(s["accepted"] / s["drafted"], 4) if s["drafted"] else None,
            "draft_ms_per_token": dms, "draft_ms_source": source,
            "verify_ms_per_round": round(s["time_verify_s"] / s["rounds"] * 1e3, 3) if s["rounds"] else None}


# -- the run -------------------------------------------------------------------------------------------
@dataclass
class Matrix:
    settings: PrecisionSettings
    prompts: PromptSet
    drafts: dict[str, DraftSource]
    shipped_draft: str | None
    make_runner: Callable[[str, dict[str, dict[str, Any]], Sequence[list[int]]], Any]
    say: Say = say_stderr
    clock: Callable[[], float] = time.perf_counter


def run_target_pass(m: Matrix, precision: str, n_cores: int) -> dict[str, Any]:
    """One target precision: its engines side by side, then its rows and peers."""
    s = m.settings
    engines, arms = pass_engines(precision, m.drafts, s.layouts, s.peers, n_cores, m.shipped_draft)
    sc = Scenario(settings=s, make_runner=lambda eng, warm: m.make_runner(precision, eng, warm), say=m.say,
                  clock=m.clock)
    summary, result = sc.run_pass(f"target {precision}", engines, arms, s.n_repeats, m.prompts)
    engines_desc = summary["engines"]
    target_dir = (engines_desc.get(TARGET_ONLY) or {}).get("target_dir")
    target = {"dir": target_dir, "weights_mb": weights_mb(target_dir), "kv": kv_cache(target_dir),
              "target_alone_tokens_per_s": tokens_per_s(result.samples.get(TARGET_ONLY, []))}
    rows = []
    for d, src in m.drafts.items():
        for layout in s.layouts:
            rows.append(_row(precision, d, src, layout, arm_name(d, layout), summary, result, target,
                             shipped=d == m.shipped_draft and layout == "auto"))
    own = peer_draft(m.drafts, m.shipped_draft)
    peers = [_peer(precision, name, summary, result, own) for name in s.peers]
    return {"precision": precision, "target": target, "pass": summary, "rows": rows, "peers": peers,
            "_result": result}


def _vs(summary: dict[str, Any], name: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    e = summary["arms"].get(name) or {"status": "failed", "reason": "did not run"}
    return e, e.get("vs_target_only") if e.get("status") == "ok" else None


def _row(precision: str, draft: str, src: DraftSource, layout: str, name: str, summary: dict[str, Any],
         result, target: dict[str, Any], shipped: bool) -> dict[str, Any]:
    kv = target["kv"]
    row: dict[str, Any] = {
        "target_precision": precision, "draft_precision": draft, "layout": layout, "arm": name,
        "kv_dtype": f"auto ({kv['dtype']})" if kv else "auto", "shipped_recommendation": shipped,
        "draft_source": {"model": str(src.model) if src.model else None, "draft.precision": src.precision},
        "status": "unavailable" if src.model is None else "failed", "reason": src.reason,
        "resolved_layout": None, "acceptance": None, "accepted": None, "drafted": None, "drafting_prompts": None,
        "tokens_per_s": None,
        "draft_ms_per_token": None, "draft_ms_source": None, "verify_ms_per_round": None,
        "target_mb": target["weights_mb"], "draft_mb": None,
        "kv_bytes_per_token": kv["bytes_per_token"] if kv else None,
        "kv_mb_1k": kv["mb_at"]["1024"] if kv else None, "kv_mb_8k": kv["mb_at"]["8192"] if kv else None,
        "speedup": None, "speedup_min": None, "speedup_max": None, "won": None, "identical": None}
    if src.model is None:
        return row
    e, v = _vs(summary, name)
    desc = summary["engines"].get(name) or {}
    row["draft_mb"] = weights_mb(desc.get("draft_model"))
    if v is None:
        row["reason"] = e.get("reason")
        return row
    placement = desc.get("placement")
    row["resolved_layout"] = (placement["chosen"] + (f", {placement['switches']} switch(es)"
                                                     if placement["switches"] else "")) if placement else \
        f"{desc.get('layout')} (target {desc.get('target_threads')} thread(s), draft {desc.get('draft_threads')})"
    row["resolved_layout"] = row["resolved_layout"].replace(" thread(s), draft ", "+").replace("(target ", "(threads ")
    row.update(status="ok", reason=None, **arm_measures(result.samples[name]),
               speedup=v["median"], speedup_min=v["min"], speedup_max=v["max"], won=f"{v['won']}/{v['prompts']}",
               identical=f"{v['identical']}/{v['prompts']}")
    return row


def _peer(precision: str, name: str, summary: dict[str, Any], result, draft: str | None) -> dict[str, Any]:
    e, v = _vs(summary, name)
    desc = summary["engines"].get(name) or {}
    spec = PEERS[name] != "ort_genai_target_only_all_cores"
    out: dict[str, Any] = {"target_precision": precision, "name": name, "system": PEERS[name],
                           "draft_precision": draft if spec else None,
                           "status": e["status"], "reason": e.get("reason"),
                           "threads": desc.get("target_threads"), "gamma": desc.get("gamma")}
    if v is not None:
        measures = arm_measures(result.samples[name])
        out.update(speedup=v["median"], speedup_min=v["min"], speedup_max=v["max"],
                   won=f"{v['won']}/{v['prompts']}", identical=f"{v['identical']}/{v['prompts']}",
                   tokens_per_s=measures["tokens_per_s"])
        if PEERS[name] != "ort_genai_target_only_all_cores":  # ORT GenAI's speculative stats
            out.update({k: measures[k] for k in ("acceptance", "draft_ms_per_token", "verify_ms_per_round")})
    return out


def headline(passes: dict[str, dict[str, Any]], shipped_draft: str | None) -> dict[str, Any]:
    """(a) best heterogeneous layout with the shipped draft / ORT GenAI speculative on one core; (b) the shipped
    recommendation / the target alone on all cores, with identity. Both at the int8 target."""
    p = passes.get(HEADLINE_TARGET)
    if p is None:
        why = f"the {HEADLINE_TARGET} target was not measured"
        return {"target_precision": HEADLINE_TARGET, "a": {"available": False, "reason": why},
                "b": {"available": False, "reason": why}}
    rows = [r for r in p["rows"] if r["status"] == "ok"]
    mine = [r for r in rows if r["draft_precision"] == shipped_draft and r["layout"] in ("auto", "two_process")]
    a: dict[str, Any] = {"available": False, "goal": GOAL_VS_ORT, "draft": shipped_draft}
    if not mine:
        a["reason"] = f"no heterogeneous arm with the shipped draft ({shipped_draft}) completed"
    elif ORT_SPEC_1CORE not in p["_result"].samples:
        peer = next((x for x in p["peers"] if x["name"] == ORT_SPEC_1CORE), None)
        a["reason"] = f"{ORT_SPEC_1CORE}: " + (peer["reason"] if peer else "not measured (peers skipped)")
    else:
        best = max(mine, key=lambda r: r["speedup"])
        v = pair_arms(p["_result"], best["arm"], ORT_SPEC_1CORE)
        a.update(available=True, arm=best["arm"], resolved_layout=best["resolved_layout"],
                 vs_target_only=best["speedup"], vs_ort_spec_1core=v, ratio=v["median"],
                 met=v["median"] >= GOAL_VS_ORT,
                 vs_ort_spec_all_cores=pair_arms(p["_result"], best["arm"], "ort_genai_spec all cores"),
                 choice_note="the better of auto and two_process by median speedup over the target alone, "
                             "then paired with the peer in the same pass")
    b: dict[str, Any] = {"available": False, "goal": GOAL_SHIPPED, "draft": shipped_draft}
    shipped = next((r for r in p["rows"] if r["shipped_recommendation"]), None)
    if shipped is None or shipped["status"] != "ok":
        b["reason"] = (f"the shipped recommendation did not complete: {shipped['reason']}" if shipped
                       else "the shipped recommendation (shipped draft, auto layout) was not measured")
    else:
        b.update(available=True, arm=shipped["arm"], resolved_layout=shipped["resolved_layout"],
                 ratio=shipped["speedup"], range=[shipped["speedup_min"], shipped["speedup_max"]],
                 won=shipped["won"], identical=shipped["identical"], met=shipped["speedup"] >= GOAL_SHIPPED,
                 vs_ort_target_only_all_cores=pair_arms(p["_result"], shipped["arm"],
                                                        "ort_genai_target_only all cores"))
    return {"target_precision": HEADLINE_TARGET, "a": a, "b": b}


def build_prompts(s: PrecisionSettings, config) -> PromptSet:
    """Timed held-out prompts, and WARMUP_PROMPTS others every engine decodes first, untimed (with
    --prompts-file or prompt_ids: their first prompts, which are timed too)."""
    n, w = s.n_prompts, WARMUP_PROMPTS
    if s.prompt_ids is not None:
        ids = [list(p) for p in s.prompt_ids]
        return PromptSet(ids[:n], ids[:w], f"{len(ids[:n])} given prompts; warm-up: the first {w} (also timed).")
    ids, from_file = _prompt_sources(s, config, n + w)
    if from_file:
        n = s.prompts or len(ids)
        return PromptSet(ids[:n], ids[:w], f"{n} prompts of {s.prompts_file}; warm-up: its first {w} (also timed).")
    if len(ids) < n + w:
        raise BenchError(f"only {len(ids)} held-out prompts; {n + w} needed")
    return PromptSet(ids[:n], ids[n:n + w], f"{n} held-out prompts of {s.prompt_tokens} tokens; every engine first "
                                            f"decodes {w} other held-out prompts untimed (warm-up).")


def shipped_draft_of(config, drafts: dict[str, DraftSource]) -> str | None:
    """The precision label whose source is the config's own draft (the shipped one), if any."""
    if config.draft.kind != "onnx" or config.draft.model is None:
        return None
    own, precision = Path(config.draft.model).resolve(), config.draft.precision
    return next((d for d, src in drafts.items()
                 if src.model is not None and src.precision == precision and src.model.resolve() == own), None)


def run_precision(s: PrecisionSettings, make_runner=None, say: Say = say_stderr) -> dict[str, Any]:
    """Run the matrix and write OUT/precision.json, precision.md, precision.png. Returns the report."""
    from ..config import check_paths, load_config
    from .report import _machine, _versions
    from .systems import cores

    t0 = time.perf_counter()

    def progress(text: str) -> None:
        say(f"[{time.perf_counter() - t0:6.0f} s] {text}")

    base = {**s.overrides, **CPU_FP32}
    config = load_config(s.config, overrides=base)
    check_paths(config)
    prompts = build_prompts(s, config)
    if not prompts.prompts or any(not p for p in prompts.prompts):
        raise BenchError("no prompts to benchmark (or an empty prompt)")
    _check_context(config, (prompts,), s.max_new)
    drafts = dict(s.drafts) if s.drafts is not None else draft_sources(config, s.config, s.draft_hf,
                                                                       s.draft_precisions)
    shipped = shipped_draft_of(config, drafts)
    n_cores = cores()
    make = make_runner or (lambda precision, engines, warmup: PrecisionRunner(
        s.config, {**base, "target.precision": precision}, engines, warmup, s.max_new,
        lambda text: progress(f"  {text}"), s.out, s.gammas))
    m = Matrix(settings=s, prompts=prompts, drafts=drafts, shipped_draft=shipped, make_runner=make, say=progress)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    passes: dict[str, dict[str, Any]] = {}
    try:
        for precision in s.target_precisions:
            progress(f"target {precision}: start ({len(drafts)} draft(s) x {len(s.layouts)} layout(s), "
                     f"{len(s.peers)} peer(s))")
            passes[precision] = run_target_pass(m, precision, n_cores)
            progress(f"target {precision}: done")
    finally:
        hf_logging.set_verbosity(verbosity)
    head = headline(passes, shipped)
    report = {
        "machine": _machine(), "versions": _versions(),
        "config": {"source": config.source, **config.model_dump(mode="json")},
        "settings": {"command": command_line(s), "prompts": len(prompts.prompts), "max_new_tokens": s.max_new,
                     "repeats": s.n_repeats, "prompts_note": prompts.note, "cores": n_cores,
                     "target_precisions": list(s.target_precisions), "draft_precisions": list(drafts),
                     "layouts": list(s.layouts), "kv_dtypes": list(KV_DTYPES), "peers": list(s.peers),
                     "ort_gammas": list(s.gammas) if s.gammas else None, "shipped_draft": shipped,
                     "overrides": s.overrides, "method": METHOD, "layouts_note": LAYOUTS_NOTE},
        "drafts": {d: {"model": str(src.model) if src.model else None, "draft.precision": src.precision,
                       "reason": src.reason} for d, src in drafts.items()},
        "targets": {p: v["target"] for p, v in passes.items()},
        "rows": [r for v in passes.values() for r in v["rows"]],
        "peers": [x for v in passes.values() for x in v["peers"]],
        "passes": {p: v["pass"] for p, v in passes.items()},
        "headline": head, "wall_s": round(time.perf_counter() - t0, 1)}
    write_outputs(s.out, report)
    return report


METHOD = ("one pass per target precision: its engines start together (each warmed up untimed), the arms run "
          "interleaved per prompt (the order rotating from prompt to prompt and repeat to repeat), a prompt's time "
          "is the median of its repeats, and every arm is paired per prompt with the target alone at the same "
          "precision, in process on every core (draft.kind none): throughput ratio (its tokens/s over the "
          "target's), median over prompts; greedy output token ids are compared with the target's.")
LAYOUTS_NOTE = {
    "auto": "the shipped placement (runtime.mode auto, runtime.cpus auto): layout and core split chosen by "
            "measurement on this machine, possibly switched once the acceptance is known",
    "two_process": "the draft worker on its own core, 1 target thread + 1 draft thread, pinned",
    "in_process": "draft and verify in turn, the target on every core, the draft on 1 thread"}


# -- report: Markdown and plot -------------------------------------------------------------------------
def _x(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _kv_text(r: dict[str, Any]) -> str:
    if r.get("kv_bytes_per_token") is None:
        return "-"
    return f"{r['kv_bytes_per_token']:,} B ({r['kv_mb_1k']:.1f} / {r['kv_mb_8k']:.1f} MB)"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| target | draft | layout: resolved | KV dtype | acceptance (accepted/drafted; prompts drafting) | "
           "draft ms/token | "
           "verify ms/round | target MB | draft MB | KV/token (1k / 8k ctx) | speedup vs target alone (range, "
           "won) | identical |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        star = " *" if r["shipped_recommendation"] else ""
        head = f"| {r['target_precision']} | {r['draft_precision']} | {r['layout']}{star}"
        if r["status"] != "ok":
            out.append(f"{head} | {r['kv_dtype']} | - | - | - | {_x(r['target_mb'], '.1f')} | "
                       f"{_x(r['draft_mb'], '.1f')} | {_kv_text(r)} | {r['status']}: {r['reason']} | - |")
            continue
        gate = " (w)" if r["draft_ms_source"] and r["draft_ms_source"].startswith("worker") else ""
        acc = f"{_x(r['acceptance'])} ({r['accepted']}/{r['drafted']}; drafting on {r['drafting_prompts']})"
        resolved = f" -> {r['resolved_layout']}" if r["layout"] == "auto" else f": {r['resolved_layout']}"
        out.append(f"{head}{resolved} | {r['kv_dtype']} | {acc} | "
                   f"{_x(r['draft_ms_per_token'], '.2f')}{gate} | {_x(r['verify_ms_per_round'], '.2f')} | "
                   f"{_x(r['target_mb'], '.1f')} | {_x(r['draft_mb'], '.1f')} | {_kv_text(r)} | "
                   f"{r['speedup']:.3f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}, {r['won']}) | "
                   f"{r['identical']} |")
    return out


def _peer_table(peers: list[dict[str, Any]]) -> list[str]:
    out = ["| target | peer | draft | threads | gamma | acceptance | speedup vs our target alone (range, won) | "
           "identical |",
           "|---|---|---|---:|---:|---:|---:|---:|"]
    for x in peers:
        draft = x.get("draft_precision") or "-"
        if x["status"] != "ok":
            out.append(f"| {x['target_precision']} | {x['name']} | {draft} | - | - | - | {x['status']}: {x['reason']} "
                       "| - |")
            continue
        out.append(f"| {x['target_precision']} | {x['name']} | {draft} | {x['threads'] or '-'} | {x['gamma'] or '-'} | "
                   f"{_x(x.get('acceptance'))} | {x['speedup']:.3f}x ({x['speedup_min']:.2f}-{x['speedup_max']:.2f}, "
                   f"{x['won']}) | {x['identical']} |")
    return out


def _pairing(v: dict[str, Any] | None) -> str:
    if v is None:
        return "not available"
    return (f"{v['median']:.3f}x (range {v['min']:.2f}-{v['max']:.2f}, faster on {v['won']}/{v['prompts']} prompts, "
            f"identical outputs {v['identical']}/{v['prompts']})")


def _headline_md(h: dict[str, Any]) -> list[str]:
    a, b, p = h["a"], h["b"], h["target_precision"]
    lines = [f"## Headline ({p} target)", ""]
    if a["available"]:
        lines.append(f"- (a) best heterogeneous layout with the shipped draft ({a['draft']}): `{a['arm']}` "
                     f"({a['resolved_layout']}; {a['vs_target_only']:.3f}x the target alone) / ORT GenAI "
                     f"speculative, same {p} target, 1 core: {_pairing(a['vs_ort_spec_1core'])}. Goal >= "
                     f"{a['goal']}x: {'met' if a['met'] else '**not met**'}. (Against ORT GenAI speculative on all "
                     f"cores: {_pairing(a['vs_ort_spec_all_cores'])}.)")
    else:
        lines.append(f"- (a) best heterogeneous layout / ORT GenAI speculative on 1 core: not available "
                     f"({a['reason']}).")
    if b["available"]:
        lines.append(f"- (b) shipped recommendation (configs as shipped + target.precision {p}: `{b['arm']}`, "
                     f"{b['resolved_layout']}) / the {p} target alone on all cores: {b['ratio']:.3f}x (range "
                     f"{b['range'][0]:.2f}-{b['range'][1]:.2f}, faster on {b['won']}); identical outputs "
                     f"{b['identical']}. Goal >= {b['goal']}x: {'met' if b['met'] else '**not met**'}. (Against "
                     f"ORT GenAI's target alone on all cores: {_pairing(b['vs_ort_target_only_all_cores'])}.)")
    else:
        lines.append(f"- (b) shipped recommendation / target alone on all cores: not available ({b['reason']}).")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    s, mach = report["settings"], report["machine"]
    lines = ["# hetero-spec bench: precision matrix", "", f"`{s['command']}`", "",
             f"{s['prompts']} prompts x {s['max_new_tokens']} new tokens x {s['repeats']} repeat(s), greedy, "
             f"{s['cores']} usable CPUs of {mach['cpu_count']} ({mach['cpu_model']}). {s['prompts_note']} "
             f"Total {report['wall_s']:.0f} s.", "",
             f"Method: {s['method']}", "",
             "Layouts: " + "; ".join(f"`{k}`: {s['layouts_note'][k]}" for k in s["layouts"]) + ". "
             "Every heterogeneous arm uses `speculation.gamma: auto`. * marks the shipped recommendation "
             "(configs as shipped, only target.precision changed).", "",
             "Drafts: " + "; ".join(
                 f"{d}: {v['model'] or '-'}" + (f" exported at draft.precision {v['draft.precision']}"
                                                if v["draft.precision"] else "")
                 + (f" ({v['reason']})" if v["reason"] else "") for d, v in report["drafts"].items()) + ".", "",
             "KV dtype: only `auto` exists (the export's own KV dtype); the KV column is the target's cache: 2 x "
             "layers x kv_heads x head_dim x element bytes per token, then at 1k and 8k tokens of context (MB = "
             "10^6 bytes). Weights: model.onnx + model.onnx.data on disk. Draft ms/token: time_draft_s / drafted "
             "in process; (w): two_process, where drafting runs in the worker off the request's clock, the "
             "worker-measured estimate of the gate. Acceptance and costs: Engine stats of each prompt's first "
             "repeat; 'drafting on 0/N': the cost gate kept speculation off on every prompt, so the arm is the "
             "target decoding alone in that layout. Identity: prompts whose greedy output equals the target "
             "alone at the same precision (a quantized target may differ from fp32; counted, never failed).", ""]
    for p, t in report["targets"].items():
        kv = t["kv"]
        kv_txt = (f"{kv['layers']} layers x {kv['kv_heads']} KV heads x head_dim {kv['head_dim']} x "
                  f"{kv['element_bytes']} B ({kv['dtype']})") if kv else "-"
        lines.append(f"- target {p}: {t['dir']} ({_x(t['weights_mb'], '.1f')} MB); KV: {kv_txt}; alone (the "
                     f"reference): {_x(t.get('target_alone_tokens_per_s'), '.1f')} tok/s (median over prompts)")
    lines += ["", "## Matrix", "", *_table(report["rows"]), ""]
    if report["peers"]:
        lines += ["## Peers (ONNX Runtime GenAI, same target export)", "",
                  "Paired with our target alone (in process, all cores) in the same pass. ORT GenAI speculative "
                  f"uses the config's draft ({s['shipped_draft'] or 'config'}); its max_draft_tokens is calibrated "
                  f"over {s['ort_gammas']} on the warm-up prompts.", "", *_peer_table(report["peers"]), ""]
    lines += _headline_md(report["headline"])
    for p, ps in report["passes"].items():
        lines.append("")
        lines.append(f"(target {p}: pass {ps['wall_s']:.0f} s, {ps['prompts']} prompts x {ps['repeats']} repeat(s))")
    return "\n".join(lines) + "\n"


DRAFT_COLORS = {"fp32": "#2a7ab9", "int8": "#d04a02", "int4": "#3a9a3a"}
LAYOUT_HATCH = {"auto": "", "two_process": "//", "in_process": ".."}


def plot(report: dict[str, Any], path: Path) -> None:
    """Grouped bars: per target precision, the median speedup over that target alone of every draft x layout
    (min-max bars), then the ORT GenAI peers in grey."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    targets = list(report["targets"])
    groups = [([r for r in report["rows"] if r["target_precision"] == p],
               [x for x in report["peers"] if x["target_precision"] == p]) for p in targets]
    width = max((len(rows) + len(peers) for rows, peers in groups), default=1) + 1
    fig = Figure(figsize=(max(6.0, 1.6 + 0.45 * width * max(1, len(targets))), 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    greys = {"ort_genai_spec 1 core": "#999999", "ort_genai_spec all cores": "#666666",
             "ort_genai_target_only all cores": "#cccccc"}
    centers = []
    for g, (rows, peers) in enumerate(groups):
        x0 = g * width
        bars = [(r["speedup"], r["speedup_min"], r["speedup_max"], DRAFT_COLORS.get(r["draft_precision"], "#888"),
                 LAYOUT_HATCH.get(r["layout"], "")) for r in rows]
        bars += [(x.get("speedup"), x.get("speedup_min"), x.get("speedup_max"), greys.get(x["name"], "#aaa"), "")
                 for x in peers]
        for i, (m, lo, hi, color, hatch) in enumerate(bars):
            if m is None:
                ax.annotate("n/a", (x0 + i, 0.02), ha="center", fontsize=7, rotation=90)
                continue
            ax.bar(x0 + i, m, color=color, hatch=hatch, edgecolor="black", linewidth=0.4,
                   yerr=[[m - lo], [hi - m]], capsize=2)
            ax.annotate(f"{m:.2f}", (x0 + i, hi), textcoords="offset points", xytext=(0, 2), ha="center",
                        fontsize=6)
        centers.append(x0 + (len(bars) - 1) / 2)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks(centers, [f"target {p}" for p in targets])
    ax.set_ylabel("throughput vs the same target alone (per prompt, median)")
    ax.set_title("precision matrix: speedup over own target-only")
    handles = [Patch(facecolor=c, label=f"draft {d}") for d, c in DRAFT_COLORS.items()
               if any(r["draft_precision"] == d for r in report["rows"])]
    handles += [Patch(facecolor="white", edgecolor="black", hatch=h, label=lay) for lay, h in LAYOUT_HATCH.items()
                if lay in report["settings"]["layouts"]]
    handles += [Patch(facecolor=c, label=n) for n, c in greys.items() if n in report["settings"]["peers"]]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(path, dpi=120)


def write_outputs(out: Path, report: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "precision.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "precision.md").write_text(render_markdown(report))
    plot(report, out / "precision.png")
    return [out / "precision.json", out / "precision.md", out / "precision.png"]


# -- command line -------------------------------------------------------------------------------------
def precision_settings(args) -> PrecisionSettings:
    """`hetero-spec bench --precision-matrix ...` arguments -> settings; options with no meaning here are
    refused, naming the option."""
    from ..config import parse_override

    if args.scenarios:
        raise BenchError("--precision-matrix and --scenario are separate benchmarks: choose one")
    for opt, given in (("--ort-target", args.ort_target), ("--sampling", args.sampling),
                       ("--temperature", args.temperature)):
        if given:
            raise BenchError(f"{opt} does not apply with --precision-matrix: every arm decodes greedily, and the "
                             "ORT GenAI target is the export at each target precision")
    if getattr(args, "llama_cpp", None):
        raise BenchError("--llama-cpp applies to the system comparison, not to --precision-matrix")
    if isinstance(args.prompts, str):
        raise BenchError(f"--prompts {args.prompts} applies to the system comparison; with --precision-matrix "
                         "give the prompts with --prompts-file")
    for opt, val in (("--prompts", args.prompts), ("--max-new-tokens", args.max_new_tokens),
                     ("--repeats", args.repeats), ("--prompt-tokens", args.prompt_tokens)):
        if val is not None and val < 1:
            raise BenchError(f"{opt} must be >= 1, got {val}")
    gammas: tuple[int, ...] | None = DEFAULT_GAMMAS
    if args.gammas is not None:
        if args.gammas.strip() == "config":
            gammas = None
        else:
            try:
                gammas = tuple(int(g) for g in args.gammas.split(",") if g.strip())
            except ValueError:
                raise BenchError(f"--gammas must be comma-separated integers or 'config', got {args.gammas!r}") \
                    from None
            if not gammas or any(not 1 <= g <= 64 for g in gammas):
                raise BenchError(f"--gammas: each draft length must be in 1..64, got {args.gammas!r}")
    targets, drafts = parse_matrix(args.precision_matrix)
    return PrecisionSettings(
        config=Path(args.config), out=Path(args.out), prompts=args.prompts, max_new_tokens=args.max_new_tokens,
        repeats=args.repeats, quick=args.quick, overrides=dict(parse_override(p) for p in args.overrides),
        prompt_tokens=args.prompt_tokens or 128, prompts_file=Path(args.prompts_file) if args.prompts_file else None,
        draft_hf=Path(args.draft_hf) if args.draft_hf else None, target_precisions=targets,
        draft_precisions=drafts, layouts=parse_layouts(args.layouts), peers=parse_peers(args.systems), gammas=gammas)


def command_line(s: PrecisionSettings) -> str:
    import shlex

    matrix = ",".join(s.target_precisions) + ("" if tuple(s.draft_precisions) == PRECISIONS
                                               else "/" + ",".join(s.draft_precisions))
    parts = ["hetero-spec", "bench", "--config", str(s.config), "--out", str(s.out), "--precision-matrix"]
    if tuple(s.target_precisions) != PRECISIONS or tuple(s.draft_precisions) != PRECISIONS:
        parts.append(matrix)
    parts += ["--prompts", str(s.n_prompts), "--max-new-tokens", str(s.max_new), "--repeats", str(s.n_repeats)]
    if s.quick:
        parts.append("--quick")
    if tuple(s.layouts) != DEFAULT_LAYOUTS:
        parts += ["--layouts", ",".join(s.layouts)]
    if tuple(s.peers) != tuple(PEERS):
        parts += ["--systems", ",".join(PEERS[p] for p in s.peers) or "none"]
    if s.gammas != DEFAULT_GAMMAS:
        parts += ["--gammas", ",".join(map(str, s.gammas)) if s.gammas else "config"]
    return shlex.join(parts + input_flags(s))


def run_precision_cli(args) -> int:
    s = precision_settings(args)
    report = run_precision(s)
    print(render_markdown(report), end="")
    print(f"[bench: {report['wall_s']:.0f} s; wrote {s.out / 'precision.json'}, precision.md, precision.png]",
          file=sys.stderr)
    return 0
