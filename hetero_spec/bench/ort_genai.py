"""ONNX Runtime GenAI's target alone and its own speculative decoding (`og.Generator`, greedy), on the target's
ONNX export at target.precision (linked into OUT/ort_models/) and the config's ONNX draft. ORT GenAI puts both
models on one device, so they take turns on the same threads: each system is calibrated over one thread and
every core (and the speculative one over --gammas for max_draft_tokens), and keeps the fastest."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

from .harness import WARMUP_TOKENS, BenchContext, RunOutput, System, calibrate, register, thread_options


def ort_target_dir(ctx: BenchContext) -> Path:
    """The target's ONNX export (the onnx backend's cached one at target.precision, or --ort-target), linked
    into OUT/ort_models/target[-PRECISION], where the draft can be put beside it."""
    from ..target.backends import precision_of
    from ..target.export_cache import SOURCE_NAME, cached_export

    precision = precision_of(ctx.config.target)
    out = ctx.out / "ort_models" / ("target" if precision == "fp32" else f"target-{precision}")
    src = Path(ctx.ort_target) if ctx.ort_target else cached_export(ctx.config.target.model, precision)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != SOURCE_NAME:
            _place(f, out / f.name)
    return out


def _place(src: Path, dst: Path) -> None:
    """Hard-link (or copy) src to dst unless the same file is there already."""
    if dst.is_file() and (dst.stat().st_size, dst.stat().st_mtime_ns) == (src.stat().st_size, src.stat().st_mtime_ns):
        return
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def spec_overlay(target_dir: Path, draft_dir: Path, gamma: int, threads: int) -> dict[str, Any]:
    """Put the ONNX draft inside the target's folder (ORT GenAI refuses model paths outside it) and return the
    genai_config overlay: a `model.draft` block (the draft's own decoder block) and max_draft_tokens."""
    (target_dir / "draft").mkdir(exist_ok=True)
    for f in Path(draft_dir).iterdir():
        if f.name.startswith("model.onnx"):  # model.onnx and its external data, names kept
            _place(f, target_dir / "draft" / f.name)
    block = json.loads((Path(draft_dir) / "genai_config.json").read_text())["model"]["decoder"]
    block["filename"] = "draft/model.onnx"
    block.setdefault("session_options", {})["intra_op_num_threads"] = threads
    return {"model": {"draft": block}, "speculative": {"max_draft_tokens": gamma}}


@register
class OrtGenaiTargetOnly(System):
    """ONNX Runtime GenAI's target alone (the same ONNX export as our onnx backend), its threads calibrated."""

    name, speculative, peer_reference = "ort_genai_target_only", False, "ort_genai_target_only"

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        return "onnxruntime-genai is not installed" if importlib.util.find_spec("onnxruntime_genai") is None else None

    def setup(self, ctx: BenchContext) -> None:
        import onnxruntime_genai as og

        self.og, self.ctx, self.models, self.dir = og, ctx, {}, ort_target_dir(ctx)
        self.per_generator = hasattr(og.GeneratorParams, "set_speculative_options")  # else k is in the config
        eos = json.loads((self.dir / "genai_config.json").read_text())["model"].get("eos_token_id", [])
        self.eos = {int(e) for e in (eos if isinstance(eos, list) else [eos])}
        grid = [(t, g) for t in thread_options() for g in ((ctx.gammas or (ctx.gamma,)) if self.speculative else (None,))]
        self.setting = grid[0]
        if len(grid) > 1:
            self.setting, self.calibration = calibrate(self._run, grid, ctx.calibration_prompts, ctx.max_new)
        self.models = {k: m for k, m in self.models.items() if k == self._key(self.setting)}  # free the others

    def _key(self, setting: tuple) -> tuple:
        return (setting[0], None if self.per_generator else setting[1])

    def _model(self, setting: tuple):
        """The model loaded with these threads (and k, where it cannot be set per generator), warmed up once."""
        key = self._key(setting)
        if key not in self.models:
            threads, k = setting
            overlay: dict[str, Any] = spec_overlay(self.dir, self.ctx.config.draft.model, k, threads) if k else {}
            overlay.setdefault("model", {})["decoder"] = {"session_options": {"intra_op_num_threads": threads}}
            (self.dir / "genai_config.overlay.json").write_text(json.dumps(overlay, indent=1))  # for reference
            cfg = self.og.Config(str(self.dir))
            cfg.overlay(json.dumps(overlay))
            self.models[key] = self.og.Model(cfg)
            self._run(setting, self.ctx.prompts[0], min(WARMUP_TOKENS, self.ctx.max_new))
        return self.models[key]

    def _run(self, setting: tuple, prompt_ids: list[int], max_new: int) -> RunOutput:
        og, model = self.og, self._model(setting)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt_ids) + max_new, do_sample=False)
        if setting[1] and self.per_generator:
            params.set_speculative_options(max_draft_tokens=setting[1])
        gen = og.Generator(model, params)
        gen.append_tokens(prompt_ids)
        n0 = len(prompt_ids)
        while not gen.is_done() and gen.token_count() - n0 < max_new:
            gen.generate_next_token()
        ids = [int(t) for t in gen.get_sequence(0)[n0:n0 + max_new]]
        if gen.is_done() and len(ids) < max_new and int(gen.get_next_tokens()[0]) in self.eos:
            ids.append(int(gen.get_next_tokens()[0]))  # ORT GenAI drops the stop token; the others keep it
        if not setting[1]:
            return RunOutput(ids)
        s = gen.get_speculative_stats()
        return RunOutput(ids, {"drafted": s.get("draft_tokens_proposed", 0), "accepted": s.get("draft_tokens_accepted", 0),
                               "rounds": s.get("rounds", 0), "effective_k": s.get("effective_k")})

    def run(self, prompt_ids: list[int], max_new: int) -> RunOutput:
        return self._run(self.setting, prompt_ids, max_new)

    def describe(self, ctx: BenchContext) -> dict[str, Any]:
        t, k = self.setting
        return {"backend": "onnxruntime-genai", "layout": "in_process" + (" (draft and verify in turn)" if k else ""),
                "target_threads": t, "draft_threads": t if k else None, "gamma": k, "target_dir": str(self.dir)}

    def close(self) -> None:
        self.models = {}


@register
class OrtGenaiSpec(OrtGenaiTargetOnly):
    """ONNX Runtime GenAI's speculative decoding with the config's ONNX draft: max_draft_tokens over --gammas
    and its threads calibrated."""

    name, speculative = "ort_genai_spec", True

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        d = ctx.config.draft
        if d.kind != "onnx" or d.model is None or not (Path(d.model) / "genai_config.json").is_file():
            return "needs an ONNX draft exported by the model builder (draft.kind onnx, with genai_config.json)"
        return super().unavailable(ctx)
