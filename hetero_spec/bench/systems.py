"""The system registry, the reference (target_only: the configured target alone), and the transformers and
hetero_spec systems."""

from __future__ import annotations

import os
import time
from typing import Any

from ..config import RuntimeConfig
from .context import CALIBRATION_K, WARMUP_TOKENS, BenchContext, RunOutput, load_hf


class System:
    """Base of a benchmarked system. Subclasses set `name` and implement setup/run (close if needed)."""

    name = "?"
    #: (accepted, drafted) keys of the system's per-run stats, for a per-token acceptance rate; None: n/a
    acceptance_keys: tuple[str, str] | None = None
    #: runs only when named in --systems (the transformers fp32 systems: a whole fp32 copy of the target each)
    opt_in = False
    #: a second reference of this system's outputs, e.g. a peer's own target alone (identical_to_<name>)
    peer_reference: str | None = None

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

    def describe(self, ctx: BenchContext) -> dict[str, Any]:
        """What runs: backend, layout, threads (shown in bench.json and bench.md)."""
        return {"backend": "torch (transformers)", "layout": "in_process", "target_threads": ctx.torch_threads,
                "draft_threads": None}


def cores() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def calibrate(run_k, candidates: tuple[int, ...], prompts: list[list[int]], max_new: int
              ) -> tuple[int, dict[int, float]]:
    """Give a speculative system its best gamma before it is compared: time each candidate on the
    calibration prompts (untimed for the report) and keep the fastest. run_k(k, prompt, max_new); where it
    returns a RunOutput that timed itself (own_wall_s, e.g. llama.cpp's clock without its process start),
    that time counts instead of the wall clock."""
    times: dict[int, float] = {}
    for k in candidates:
        times[k] = 0.0
        for p in prompts:
            t = time.perf_counter()
            out = run_k(k, p, max_new)
            elapsed = time.perf_counter() - t
            own = out.own_wall_s if isinstance(out, RunOutput) else None
            times[k] += own if own is not None else elapsed
    return min(times, key=times.get), times


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


class HeteroSpec(System):
    """This project's engine with the config as given: `Engine.generate(prompt_ids, gamma=best,
    temperature=--temperature, seed=0)`; gamma is calibrated over --gammas first (the config's otherwise)."""

    name = "hetero_spec"
    acceptance_keys = ("accepted", "drafted")
    runtime_overrides: dict[str, Any] = {}

    def overrides(self, ctx: BenchContext) -> dict[str, Any]:
        return dict(self.runtime_overrides)

    def setup(self, ctx: BenchContext) -> None:
        from ..engine import Engine

        # ctx.config already holds the --set overrides, --sampling and CPU_FP32
        self.temperature, self.seed = ctx.temperature, ctx.seed
        self.engine = Engine.from_config(ctx.config, overrides=self.overrides(ctx) or None)
        cfg = self.engine.config
        self.gamma, self.calibration = cfg.speculation.gamma, None
        if ctx.gammas and cfg.draft.kind != "none" and cfg.speculation.gamma != "auto":  # auto picks its own
            self.run(ctx.prompts[0], min(WARMUP_TOKENS, ctx.max_new))  # warm before timing candidates
            self.gamma, self.calibration = calibrate(self._run_k, ctx.gammas, ctx.calibration_prompts,
                                                     ctx.max_new)

    def _run_k(self, k: int | str, prompt_ids: list[int], max_new: int):
        return self.engine.generate(prompt_ids, max_new_tokens=max_new, temperature=self.temperature,
                                    seed=self.seed, gamma=k)

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        out = self._run_k(self.gamma, prompt_ids, max_new)
        return RunOutput(out.token_ids, out.stats)

    def describe(self, ctx: BenchContext) -> dict[str, Any]:
        cfg = self.engine.config
        two = cfg.runtime.mode == "two_process"
        plan = getattr(self.engine, "_cpu_plan", None)
        threads = plan.threads if plan is not None else cfg.target.threads or ctx.torch_threads
        return {"backend": cfg.target.backend, "layout": cfg.runtime.mode + (" (draft overlapped)" if two else ""),
                "target_threads": threads, "draft_threads": cfg.draft.threads if cfg.draft.kind == "onnx" else None,
                "draft": cfg.draft.kind}

    def extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {"gamma": self.gamma if self.engine.config.draft.kind != "none" else None}
        if self.calibration:
            out["calibration_s"] = {str(k): round(v, 4) for k, v in self.calibration.items()}
        return out

    def close(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.close()


@register
class TargetOnly(HeteroSpec):
    """The reference: the configured target alone, at its own backend, precision and threads (the engine with
    draft.kind none, in process), greedy even when --temperature samples the hetero_spec systems. Every
    speedup_vs_target_only and identical_to_target_only is against it; with --systems, only when named."""

    name = "target_only"
    acceptance_keys = None
    runtime_overrides = {"draft.kind": "none", "draft.candidates": [], "runtime.mode": "in_process",
                         "runtime.cpus": None}

    def setup(self, ctx: BenchContext) -> None:
        super().setup(ctx)
        self.temperature = 0.0

    def describe(self, ctx: BenchContext) -> dict[str, Any]:
        from ..target.backends import precision_of

        return {**super().describe(ctx), "precision": precision_of(self.engine.config.target)}


@register
class HfTargetOnly(System):
    """transformers `generate(do_sample=False)` on the target's checkpoint alone, fp32 on CPU. Only when named in
    --systems: it loads a whole fp32 copy of the target (7 GB for a 1.5B model), and for a quantized target it
    is a different model than the reference."""

    name = "hf_target_only"
    opt_in = True

    def setup(self, ctx: BenchContext) -> None:
        self.model = ctx.hf_model(ctx.config.target.model)

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        return RunOutput(_hf_generate(self.model, prompt_ids, max_new))


@register
class HfAssisted(System):
    """transformers assisted generation, the draft's PyTorch checkpoint as assistant, default schedule; fp32
    like hf_target_only, and like it only when named in --systems."""

    name = "hf_assisted"
    opt_in = True

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


register(HeteroSpec)


@register
class HeteroSpecPipelined(HeteroSpec):
    """The config's engine with the draft in its own process (runtime.mode = two_process)."""

    name = "hetero_spec_pipelined"
    runtime_overrides = {"runtime.mode": "two_process"}

    @staticmethod
    def unavailable(ctx: BenchContext) -> str | None:
        if ctx.config.draft.kind != "onnx":
            return "two_process needs draft.kind: onnx"
        return None


@register
class HeteroSpecTargetOnly(HeteroSpec):
    """The engine without a draft (draft.kind = none): the reference of sampled hetero_spec runs (same
    sampler, same seed; with coupled sampling their outputs must equal it). Added when --temperature > 0."""

    name = "hetero_spec_target_only"
    acceptance_keys = None
    runtime_overrides = {"draft.kind": "none", "runtime.mode": "in_process", "runtime.cpus": None}


def _onnx_target_unavailable(ctx: BenchContext) -> str | None:
    from ..target.export_cache import exportable

    model = ctx.config.target.model
    if (model / "model.onnx").is_file():
        return None
    ok, why = exportable(model)
    return None if ok else f"no ONNX target: {why}"


class _Variant(HeteroSpec):
    """The engine with a fixed backend, layout and thread split, whatever the config says."""

    backend, mode, all_cores = "onnx", "in_process", False

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        if cls.mode == "two_process":
            if ctx.config.draft.kind != "onnx":
                return "two_process needs draft.kind: onnx"
            if cores() < 2:
                return "the heterogeneous layout needs 2 CPUs (one for the draft worker)"
        return _onnx_target_unavailable(ctx) if cls.backend == "onnx" else None

    def overrides(self, ctx: BenchContext) -> dict[str, Any]:
        n = cores() if self.all_cores else 1
        out = {"target.backend": self.backend, "runtime.mode": self.mode, "runtime.cpus": None, "target.threads": n,
               "draft.threads": n, **self.runtime_overrides}
        if self.mode == "two_process":
            out.pop("target.threads")  # the worker's core is taken first; the target gets the rest
        return out


@register
class HeteroSpecOnnxTargetOnly(_Variant):
    """The onnx backend without a draft, one thread: our target step against ORT GenAI's."""

    name = "hetero_spec_onnx_target_only"
    acceptance_keys = None
    runtime_overrides = {"draft.kind": "none"}


@register
class HeteroSpecOnnx(_Variant):
    """The onnx backend, draft and verify in turn in one process, one thread each (ORT GenAI's layout)."""

    name = "hetero_spec_onnx"


@register
class HeteroSpecOnnxAllCores(_Variant):
    """The onnx backend in process with every core for the target and the draft."""

    name = "hetero_spec_onnx_all_cores"
    all_cores = True


@register
class HeteroSpecOnnxPipelined(_Variant):
    """The heterogeneous layout: the onnx target on its core(s), the draft worker on its own core."""

    name = "hetero_spec_onnx_pipelined"
    mode = "two_process"


@register
class HeteroSpecTorch(_Variant):
    """The torch (transformers) backend in process, one target thread."""

    name = "hetero_spec_torch"
    backend = "torch"


@register
class HeteroSpecTorchPipelined(HeteroSpecOnnxPipelined):
    """The torch backend with the draft worker on its own core."""

    name = "hetero_spec_torch_pipelined"
    backend = "torch"
