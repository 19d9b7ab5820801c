"""ONNX Runtime GenAI systems: its target alone and its own speculative decoding."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from .context import WARMUP_TOKENS, BenchContext, RunOutput
from .systems import System, calibrate, cores, register

log = logging.getLogger("hetero_spec.bench")


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
    """The target exported to ONNX (at target.precision) under DIR/ort_models/target[-PRECISION]; reused while the
    checkpoint is unchanged."""
    from ..target.backends import precision_of
    from ..target.export_cache import SOURCE_NAME, cached_export

    precision = precision_of(ctx.config.target)
    out = ctx.out / "ort_models" / ("target" if precision == "fp32" else f"target-{precision}")
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
    out.mkdir(parents=True)
    src = cached_export(ctx.config.target.model, precision)  # the onnx backend's export: made once, shared
    for f in src.iterdir():
        if f.is_file() and f.name != SOURCE_NAME:
            _place(f, out / f.name)
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

    peer_reference = "ort_genai_target_only"
    #: speculative options of every generator (max_draft_tokens); empty: the loaded config's
    speculative: dict[str, Any] = {}

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
        if self.speculative:
            params.set_speculative_options(**self.speculative)
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


def _per_generator_k() -> bool:
    """Whether max_draft_tokens can be set per generator (GeneratorParams.set_speculative_options)."""
    return hasattr(_og().GeneratorParams, "set_speculative_options")


def _threads_overlay(threads: int) -> dict[str, Any]:
    return {"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}


@register
class OrtGenaiTargetOnly(_OrtGenai):
    """The target exported to ONNX (fp32), decoded alone by ONNX Runtime GenAI, one thread: the target's
    device is one core here, as in the heterogeneous comparison."""

    name = "ort_genai_target_only"
    unavailable = staticmethod(_no_ort_genai)
    all_cores = False

    @property
    def threads(self) -> int:
        return cores() if self.all_cores else 1

    def setup(self, ctx: BenchContext) -> None:
        self._load(ort_target_dir(ctx), _threads_overlay(self.threads))

    def describe(self, ctx: BenchContext) -> dict[str, Any]:
        return {"backend": "onnxruntime-genai", "layout": "in_process", "target_threads": self.threads,
                "draft_threads": None}


@register
class OrtGenaiSpec(OrtGenaiTargetOnly):
    """ONNX Runtime GenAI's own speculative decoding: the ONNX target with the config's ONNX draft, drafting
    and verifying in turn on one device (one thread per model); max_draft_tokens calibrated over --gammas."""

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

    def _load_k(self, ctx: BenchContext, k: int) -> None:
        target = ort_target_dir(ctx)
        overlay = ort_spec_overlay(target, ctx.config.draft.model, k, self.threads)
        overlay["model"].update(_threads_overlay(self.threads)["model"])
        self._load(target, overlay)
        self.gamma, self.speculative = k, {}

    def _set_k(self, ctx: BenchContext, k: int) -> None:
        """max_draft_tokens = k for the next runs. GeneratorParams.set_speculative_options changes it per
        generator, on the model already loaded (onnxruntime-genai 0.18: any k, above the loaded one too); an
        older onnxruntime-genai without it reloads the model with k in its config."""
        if _per_generator_k():
            self.gamma, self.speculative = k, {"max_draft_tokens": k}
        else:
            self._load_k(ctx, k)

    def setup(self, ctx: BenchContext) -> None:
        self.calibration = None
        self._load_k(ctx, ctx.gamma)
        if not ctx.gammas:
            return
        self.run(ctx.prompts[0], min(WARMUP_TOKENS, ctx.max_new))  # warm the sessions before timing
        reloads = not _per_generator_k()

        def run_k(k: int, prompt: list[int], max_new: int) -> None:
            if self.gamma != k:
                self._set_k(ctx, k)
                if reloads:
                    self.run(ctx.prompts[0], min(WARMUP_TOKENS, ctx.max_new))  # warm the new sessions
            self.run(prompt, max_new)

        best, self.calibration = calibrate(run_k, ctx.gammas, ctx.calibration_prompts, ctx.max_new)
        self._set_k(ctx, best)

    def describe(self, ctx: BenchContext) -> dict[str, Any]:
        return {**super().describe(ctx), "layout": "in_process (draft and verify in turn)",
                "draft_threads": self.threads}

    def extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {"gamma": self.gamma}
        if self.calibration:
            out["calibration_s"] = {str(k): round(v, 4) for k, v in self.calibration.items()}
        return out

    def _stats(self, gen) -> dict[str, Any] | None:
        s = gen.get_speculative_stats()
        keep = ("rounds", "draft_tokens_proposed", "draft_tokens_accepted", "acceptance_rate",
                "total_draft_ms", "total_target_ms", "effective_k")
        return {k: s[k] for k in keep if k in s}


@register
class OrtGenaiTargetOnlyAllCores(OrtGenaiTargetOnly):
    """ORT GenAI's target alone with every core: what a user with this machine and nothing else runs."""

    name = "ort_genai_target_only_all_cores"
    all_cores = True


@register
class OrtGenaiSpecAllCores(OrtGenaiSpec):
    """ORT GenAI's speculative decoding with every core for both models."""

    name = "ort_genai_spec_all_cores"
    all_cores = True
