"""The system registry and the transformers / hetero_spec systems."""

from __future__ import annotations

import time
from typing import Any

from ..config import RuntimeConfig
from .context import CALIBRATION_K, WARMUP_TOKENS, BenchContext, RunOutput, load_hf


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
    """This project's engine, in process: `Engine.generate(prompt_ids, temperature=--temperature, seed=0)`."""

    name = "hetero_spec"
    acceptance_keys = ("accepted", "drafted")
    runtime_overrides: dict[str, Any] = {}

    def setup(self, ctx: BenchContext) -> None:
        from ..engine import Engine

        # ctx.config already holds the --set overrides, --sampling and CPU_FP32
        self.temperature, self.seed = ctx.temperature, ctx.seed
        self.engine = Engine.from_config(ctx.config, overrides=self.runtime_overrides or None)

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        out = self.engine.generate(prompt_ids, max_new_tokens=max_new, temperature=self.temperature,
                                   seed=self.seed)
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


@register
class HeteroSpecTargetOnly(HeteroSpec):
    """The engine without a draft (draft.kind = none): the reference of sampled hetero_spec runs (same
    sampler, same seed; with coupled sampling their outputs must equal it). Added when --temperature > 0."""

    name = "hetero_spec_target_only"
    acceptance_keys = None
    runtime_overrides = {"draft.kind": "none", "runtime.mode": "in_process"}
