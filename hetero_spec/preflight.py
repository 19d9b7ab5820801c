"""Preflight: a config's model paths checked before anything heavy loads (the target takes seconds to minutes),
each failure a ConfigError naming the source, the key and the value."""

from __future__ import annotations

from .config import Config
from .errors import ConfigError
from .gguf_source import check as check_gguf, is_gguf
from .target.export_cache import exportable


def check_paths(cfg: Config) -> None:
    """Model directories (or GGUF files: their metadata) must exist (and the modes fit together) before anything
    heavy loads."""
    if cfg.runtime.mode == "two_process" and cfg.draft.kind != "onnx":
        raise ConfigError(cfg.blame("runtime.mode"), "runtime.mode", cfg.runtime.mode,
                          f"two_process needs draft.kind: onnx (got {cfg.draft.kind!r}); "
                          "use runtime.mode: in_process for ngram or none")
    d = cfg.draft
    if "onnx" in d.candidates and d.kind != "onnx":
        raise ConfigError(cfg.blame("draft.candidates"), "draft.candidates", d.candidates,
                          "onnx among the candidates needs draft.kind: onnx and draft.model")
    if len(set(d.candidates)) != len(d.candidates):
        raise ConfigError(cfg.blame("draft.candidates"), "draft.candidates", d.candidates,
                          "each strategy may appear once")
    if cfg.target.model is None:
        raise ConfigError(cfg.blame("target.model"), "target.model", None, "a target model directory is required")
    if is_gguf(cfg.target.model):  # converted to a Hugging Face directory by gguf_source.resolve
        check_gguf(cfg.target.model, cfg.blame("target.model"), "target.model", onnx=cfg.target.backend == "onnx")
    else:
        _check_target_dir(cfg)
    if cfg.draft.kind == "onnx":
        if cfg.draft.model is None:
            raise ConfigError(cfg.blame("draft.model"), "draft.model", None,
                              "draft.kind is onnx, so a draft model is required")
        if is_gguf(cfg.draft.model):
            check_gguf(cfg.draft.model, cfg.blame("draft.model"), "draft.model", onnx=True)
        elif not (cfg.draft.model / "model.onnx").is_file() and cfg.draft.precision is None:
            raise ConfigError(cfg.blame("draft.model"), "draft.model", str(cfg.draft.model),
                              "no model.onnx in this directory (make one with `hetero-spec export`)")


def _check_target_dir(cfg: Config) -> None:
    """target.model as a directory: a Hugging Face checkpoint, or an export the backend can run."""
    is_export = (cfg.target.model / "model.onnx").is_file()
    if cfg.target.backend == "torch" and is_export:
        raise ConfigError(cfg.blame("target.model"), "target.model", str(cfg.target.model),
                          "this is an ONNX export, which target.backend torch cannot run; set target.backend: "
                          "onnx (or auto), or point target.model at the Hugging Face checkpoint")
    if not is_export and not (cfg.target.model / "config.json").is_file():
        raise ConfigError(cfg.blame("target.model"), "target.model", str(cfg.target.model),
                          "not a Hugging Face model directory (no config.json found)")
    if cfg.target.backend == "onnx" and not is_export:
        ok, why = exportable(cfg.target.model)
        if not ok:
            raise ConfigError(cfg.blame("target.model"), "target.model", str(cfg.target.model),
                              f"target.backend onnx needs an ONNX export of the target, but {why}; use "
                              "target.backend: torch (or auto)")
