"""Ours: the target alone (the reference), the config as given, in-process and two-process where they differ."""

from typing import Any

from ..config import build_config
from .harness import ALONE, SEED, BenchContext, RunOutput, System, cores, tune


class _Engine(System):
    """The engine with overrides(ctx) on the config (--set applied): gamma calibrated over --gammas unless auto."""

    ours, greedy = True, False  # greedy: decodes greedily even when --temperature samples the others

    def overrides(self, ctx: BenchContext) -> dict[str, Any]:
        return {}

    def setup(self, ctx: BenchContext) -> None:
        from ..engine import Engine
        self.temperature = 0.0 if self.greedy else ctx.temperature
        self.engine = Engine.from_config(ctx.config, overrides=self.overrides(ctx) or None)
        self.setting = self.engine.config.speculation.gamma if self.speculative else None
        if ctx.gammas and self.speculative and self.setting != "auto":  # auto picks its own each round
            self.setting = tune(self, ctx, self._run, ctx.gammas)
        elif self.speculative and (self.setting == "auto" or ctx.config.runtime.mode == "auto"):
            # it tunes itself as it runs (gamma, the layout between requests): the first two prompts, untimed, as a
            # peer's calibration runs them, so that it is timed settled, not while it still moves
            for prompt in ctx.prompts[:2]:
                self._run(self.setting, prompt, ctx.max_new)

    def _run(self, gamma: Any, prompt: list[int], max_new: int) -> RunOutput:
        out = self.engine.generate(prompt, max_new_tokens=max_new, temperature=self.temperature, seed=SEED, gamma=gamma)
        return RunOutput(out.token_ids, out.stats)

    def describe(self, ctx: BenchContext) -> dict[str, Any]:
        from ..target.backends import precision_of
        target, draft = self.engine.config.target, self.engine.config.draft
        return {"backend": target.backend, "precision": precision_of(target), "layout": self.engine.config.runtime.mode,
                "target_threads": target.threads, "draft": draft.kind,
                "draft_threads": draft.threads if draft.kind == "onnx" else None, "gamma": self.setting}

    def close(self) -> None:  # after a failed setup too: run_pass ignores its errors
        self.engine.close()


class TargetOnly(_Engine):
    """The reference: our target alone (draft.kind none, in process, greedy), at the config's backend and
    precision, on every core when the config leaves the split to measurement (runtime.cpus: auto), else on
    target.threads."""

    name, speculative, greedy = "target_only", False, True

    def overrides(self, ctx: BenchContext) -> dict[str, Any]:
        threads = cores() if ctx.config.runtime.cpus == "auto" else ctx.config.target.threads
        return {**ALONE, "runtime.cpus": None, **({"target.threads": threads} if threads else {})}


class HeteroSpec(_Engine):
    """hetero_spec with the config as given (--set applied): gamma calibrated over --gammas unless it is auto."""

    name = "hetero_spec"


class HeteroSpecInProcess(_Engine):
    """hetero_spec with draft and verify in turn in one process, the target on every core (runtime.mode
    in_process); skipped where that is the config itself."""

    name = "hetero_spec_in_process"

    def overrides(self, ctx: BenchContext) -> dict[str, Any]:
        return {"runtime.mode": "in_process", "runtime.cpus": None, "target.threads": cores()}

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        if ctx.config.draft.kind == "none":
            return "the config has no draft (draft.kind: none)"
        dump = ctx.config.model_dump(mode="json")  # the same config with this layout's overrides: hetero_spec
        same = build_config(dump, source=ctx.config.source, overrides=cls().overrides(ctx)).model_dump(mode="json")
        return "the config runs this layout already: see hetero_spec" if same == dump else None


class HeteroSpecTwoProcess(HeteroSpecInProcess):
    """hetero_spec with the draft in its own worker on draft.threads cores, the target on the rest, pinned
    (runtime.mode two_process); skipped where that is the config itself."""

    name = "hetero_spec_two_process"

    def overrides(self, ctx: BenchContext) -> dict[str, Any]:
        draft_threads = ctx.config.draft.threads or 1
        return {"runtime.mode": "two_process", "runtime.cpus": None, "runtime.pin_cpus": True,
                "draft.threads": draft_threads, "target.threads": max(1, cores() - draft_threads)}

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        if ctx.config.draft.kind != "onnx":
            return "two_process needs draft.kind: onnx"
        return "two_process needs 2 CPUs (one for the draft worker)" if cores() < 2 else super().unavailable(ctx)


class SampledTargetOnly(TargetOnly):
    """With --temperature: our target alone with the same sampler and seed, the reference of our sampled systems
    (with coupled sampling their outputs must equal it)."""

    name, greedy = "hetero_spec_target_only", False
