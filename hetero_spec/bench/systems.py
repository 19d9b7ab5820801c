"""Our systems (the engine: its target alone, the config as given, in-process and two-process speculation) and
transformers' assisted generation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import build_config
from .harness import SEED, WARMUP_TOKENS, BenchContext, RunOutput, System, calibrate, cores, register


class HeteroSpec(System):
    """hetero_spec with the config as given (--set applied): gamma calibrated over --gammas unless it is auto."""

    name, ours = "hetero_spec", True
    greedy = False  # target_only decodes greedily even when --temperature samples the others

    def overrides(self, ctx: BenchContext) -> dict[str, Any]:
        return {}

    def setup(self, ctx: BenchContext) -> None:
        from ..engine import Engine

        self.temperature = 0.0 if self.greedy else ctx.temperature
        self.engine = Engine.from_config(ctx.config, overrides=self.overrides(ctx) or None)
        self.gamma = self.engine.config.speculation.gamma if self.speculative else None
        if ctx.gammas and self.speculative and self.gamma != "auto":  # auto picks its own each round
            self.run(ctx.prompts[0], min(WARMUP_TOKENS, ctx.max_new))  # warm before timing candidates
            self.gamma, self.calibration = calibrate(self._run, ctx.gammas, ctx.calibration_prompts, ctx.max_new)

    def _run(self, gamma: Any, prompt_ids: list[int], max_new: int) -> RunOutput:
        out = self.engine.generate(prompt_ids, max_new_tokens=max_new, temperature=self.temperature, seed=SEED,
                                   gamma=gamma)
        return RunOutput(out.token_ids, out.stats)

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        return self._run(self.gamma, prompt_ids, max_new)

    def describe(self, ctx: BenchContext) -> dict[str, Any]:
        from ..target.backends import precision_of

        cfg, plan = self.engine.config, getattr(self.engine, "_cpu_plan", None)
        return {"backend": cfg.target.backend, "precision": precision_of(cfg.target), "layout": cfg.runtime.mode,
                "target_threads": plan.threads if plan is not None else cfg.target.threads, "draft": cfg.draft.kind,
                "draft_threads": cfg.draft.threads if cfg.draft.kind == "onnx" else None, "gamma": self.gamma}

    def close(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.close()


def _same(ctx: BenchContext, overrides: dict[str, Any]) -> bool:
    """Whether the overrides leave the config as it is (that layout is hetero_spec itself)."""
    dump = ctx.config.model_dump(mode="json")
    return build_config(dump, source=ctx.config.source, overrides=overrides).model_dump(mode="json") == dump


@register
class TargetOnly(HeteroSpec):
    """The reference: our target alone (draft.kind none, in process, greedy), at the config's backend and
    precision, on every core when the config leaves the split to measurement (runtime.cpus: auto), else on
    target.threads."""

    name, speculative, greedy = "target_only", False, True

    def overrides(self, ctx: BenchContext) -> dict[str, Any]:
        threads = cores() if ctx.config.runtime.cpus == "auto" else ctx.config.target.threads
        return {"draft.kind": "none", "draft.candidates": [], "runtime.mode": "in_process", "runtime.cpus": None,
                **({"target.threads": threads} if threads else {})}


register(HeteroSpec)


@register
class HeteroSpecInProcess(HeteroSpec):
    """hetero_spec with draft and verify in turn in one process, the target on every core (runtime.mode
    in_process); skipped where that is the config itself."""

    name = "hetero_spec_in_process"

    def overrides(self, ctx: BenchContext) -> dict[str, Any]:
        return {"runtime.mode": "in_process", "runtime.cpus": None, "target.threads": cores()}

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        if ctx.config.draft.kind == "none":
            return "the config has no draft (draft.kind: none)"
        return "the config runs this layout already: see hetero_spec" if _same(ctx, cls().overrides(ctx)) else None


@register
class HeteroSpecTwoProcess(HeteroSpecInProcess):
    """hetero_spec with the draft in its own worker on draft.threads cores, the target on the rest, pinned
    (runtime.mode two_process); skipped where that is the config itself."""

    name = "hetero_spec_two_process"

    def overrides(self, ctx: BenchContext) -> dict[str, Any]:
        d = ctx.config.draft.threads or 1
        return {"runtime.mode": "two_process", "runtime.cpus": None, "runtime.pin_cpus": True, "draft.threads": d,
                "target.threads": max(1, cores() - d)}

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        if ctx.config.draft.kind != "onnx":
            return "two_process needs draft.kind: onnx"
        return "two_process needs 2 CPUs (one for the draft worker)" if cores() < 2 else super().unavailable(ctx)


@register
class SampledTargetOnly(TargetOnly):
    """With --temperature: our target alone with the same sampler and seed, the reference of our sampled systems
    (with coupled sampling their outputs must equal it)."""

    name, greedy = "hetero_spec_target_only", False


def load_hf(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@register
class HfAssisted(System):
    """transformers assisted generation on the fp32 checkpoints of the target and the draft (--draft-hf),
    greedy; num_assistant_tokens calibrated over --gammas next to transformers' own schedule. Only when named
    in --systems (fp32 copies of both models)."""

    name, opt_in = "hf_assisted", True

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        if ctx.draft_hf is None or not (Path(ctx.draft_hf) / "config.json").is_file():
            return f"no Hugging Face draft checkpoint at {ctx.draft_hf} (pass --draft-hf DIR)"
        return None

    def setup(self, ctx: BenchContext) -> None:
        self.model, self.assistant = load_hf(ctx.config.target.model), load_hf(ctx.draft_hf)
        gc = self.assistant.generation_config
        self.own = (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold)
        self.gamma = "default"
        if ctx.gammas:
            self.run(ctx.prompts[0], min(WARMUP_TOKENS, ctx.max_new))
            self.gamma, self.calibration = calibrate(self._run, ("default", *ctx.gammas), ctx.calibration_prompts,
                                                     ctx.max_new)

    def _run(self, k: int | str, prompt_ids: list[int], max_new: int) -> RunOutput:
        import torch

        gc = self.assistant.generation_config
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = \
            self.own if k == "default" else (k, "constant", 0.0)  # a pure constant: no confidence stop
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        eos = self.model.generation_config.eos_token_id
        pad = self.model.generation_config.pad_token_id
        pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos) or 0
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                      min_new_tokens=0, do_sample=False, num_beams=1, pad_token_id=pad,
                                      assistant_model=self.assistant)
        return RunOutput(out[0, len(prompt_ids):].tolist())

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        return self._run(self.gamma, prompt_ids, max_new)

    def describe(self, ctx: BenchContext) -> dict[str, Any]:
        return {"backend": "transformers (fp32)", "layout": "in_process", "gamma": self.gamma}
