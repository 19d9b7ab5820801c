"""Precision switches: `target.precision` (with `target.dtype` as its alias), `target.kv_cache_dtype` and
`draft.precision`, checked against what the backend can run here. What each value does, per backend, and why
quantized output is identical to that target alone rather than to the checkpoint: docs/features-precision.md."""

import logging

from .config import Config, provider_name

log = logging.getLogger("hetero_spec.precision")

_FROM_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def resolve_auto(cfg: Config, recommended: str | None) -> Config:
    """target.precision auto: the profile's recommendation when allow_lossy lets it change the model, else the
    checkpoint's own precision (target.dtype's), with a log line saying which and why."""
    target = cfg.target
    if target.precision != "auto":
        return cfg
    out = cfg.model_copy(deep=True)
    out.target.precision = recommended if target.allow_lossy else None  # None: from dtype
    if not target.allow_lossy:
        why = "allow_lossy is off: the checkpoint's own precision"
    elif recommended is None:
        why = "no profile recommends one (speculation.profile, `hetero-spec profile`): the checkpoint's own"
    else:
        why = "the profile's recommendation (allow_lossy)"
    log.warning("target.precision auto: %s (%s)", out.target.precision or f"from dtype {target.dtype}", why)
    return out


def check_target(cfg: Config, backend: str, cuda: bool) -> str:
    """The target's precision: target.precision, else from target.dtype (auto: bf16 on CUDA, fp32 on a CPU),
    checked against what the backend can run here; ConfigError names the key and says why. What the backend
    cannot run is reported before a dtype that contradicts the precision: fixing the dtype first would only lead
    to the real reason (e.g. fp16 on the CPU export, which computes in fp32)."""
    target = cfg.target
    float_of = _FROM_DTYPE.get(target.dtype)
    precision = target.precision or float_of or ("bf16" if cuda else "fp32")
    _check_backend(cfg, backend, cuda, precision)
    if target.precision is not None and float_of not in (None, target.precision) and not (
            target.precision in ("int8", "int4") and float_of == "fp32"):
        raise cfg.error("target.precision", target.precision,
                        f"contradicts target.dtype: {target.dtype} (its alias for precision {float_of}); set one "
                        "of them (quantized int8/int4 targets compute in float32: dtype auto or float32)")
    return precision


def _check_block_graph(cfg: Config, backend: str, precision: str) -> None:
    """target.block_graph int8: a quantized onnx target on the CPU provider, from a checkpoint (it is made from the
    fp32 export), so that only a target already within a quantization gap of its checkpoint takes a second one."""
    target = cfg.target
    first = provider_name(target.providers[0]) if target.providers else "CPUExecutionProvider"
    why = None
    if backend != "onnx":
        why = "needs the onnx backend"
    elif precision not in ("int8", "int4"):
        why = (f"needs a quantized target (target.precision int8 or int4, not {precision}): an fp32 target keeps "
               "exact greedy identity, which a second graph's verdicts would break")
    elif first != "CPUExecutionProvider":
        why = f"runs on the CPU provider only (ONNX Runtime's DynamicQuantizeMatMul), not {first}"
    elif target.model is not None and (target.model / "model.onnx").is_file():
        why = ("is made from the checkpoint's fp32 export: target.model must be a Hugging Face directory or a GGUF "
               "file, not an export")
    if why:
        raise cfg.error("target.block_graph", target.block_graph, why)


def _check_backend(cfg: Config, backend: str, cuda: bool, precision: str) -> None:
    target = cfg.target
    if target.block_graph != "none":
        _check_block_graph(cfg, backend, precision)
    if backend == "onnx" and target.kv_cache_dtype != "auto":
        raise cfg.error("target.kv_cache_dtype", target.kv_cache_dtype, "the onnx backend keeps the export's KV "
                        "cache (fp32 in the builder's CPU graph; the builder quantizes KV caches only for "
                        "GroupQueryAttention/PagedAttention on GPU providers): use auto, or the torch backend")
    if backend != "onnx":
        if precision == "int4" or (precision == "int8" and cuda):
            raise cfg.error("target.precision", precision,
                            "the torch backend quantizes to int8 on a CPU only (PyTorch dynamic quantization); "
                            f"{precision}{' on CUDA' if cuda else ''} needs torchao, which is not installed; use the "
                            "onnx backend (int8, int4 on a CPU) or fp16/bf16")
        return
    if target.model is not None and (target.model / "model.onnx").is_file():
        if target.precision is not None:
            log.info("target.precision %s: target.model is already an export (%s); it is used as it is", precision,
                     target.model)
        return
    first = provider_name(target.providers[0]) if target.providers else "CPUExecutionProvider"
    if first == "CPUExecutionProvider" and precision not in ("fp32", "int8", "int4"):
        raise cfg.error("target.precision", precision, "the ONNX model builder's CPU export computes in fp32: choose "
                        "fp32, int8 or int4 for the CPU provider (fp16 needs a GPU provider's export: "
                        "target.providers: [CUDAExecutionProvider] or [DmlExecutionProvider]; or the torch backend "
                        "on CUDA)")
    if first != "CPUExecutionProvider" and precision not in ("fp32", "fp16", "int8", "int4"):
        raise cfg.error("target.precision", precision, f"the ONNX model builder exports fp32, fp16, int8 or int4 for "
                        f"{first}: choose one of them (bf16: the torch backend on CUDA)")


def resolve_draft(cfg: Config) -> Config:
    """draft.precision with a Hugging Face draft.model: a config whose draft.model is the cached export at that
    precision (exported now if needed). An export given with draft.precision is an error."""
    draft = cfg.draft
    if draft.kind != "onnx" or draft.model is None:
        return cfg
    model = draft.model
    is_export, has_config = (model / "model.onnx").is_file(), (model / "config.json").is_file()
    if draft.precision is None and (is_export or not has_config):  # not a Hugging Face checkpoint to export
        return _pruned(cfg)
    if is_export:
        raise cfg.error("draft.precision", draft.precision,
                        f"draft.model ({model}) is already an ONNX export with its own precision; give the "
                        "Hugging Face checkpoint to export it at draft.precision, or drop draft.precision")
    if not has_config:
        raise cfg.error("draft.model", str(model),
                        "draft.precision needs a Hugging Face checkpoint here (config.json and weights)")
    from .target.export_cache import cached_export, exportable
    exports, why = exportable(model)
    if not exports:
        raise cfg.error("draft.model", str(model), f"cannot export the draft: {why}")
    precision = draft.precision or "int8"  # a checkpoint without one: the fastest draft precision measured here
    out = cfg.model_copy(deep=True)
    out.draft.model = cached_export(model, precision, role="draft")
    out.draft.precision = None
    log.info("draft: %s at %s -> %s", model, precision, out.draft.model)
    return _pruned(out)


def _pruned(cfg: Config) -> Config:
    """draft.head: a config whose draft.model is the export's copy with its LM head pruned (made once)."""
    if cfg.draft.head is None or not (cfg.draft.model / "model.onnx").is_file():
        return cfg
    from .draft.head import cached_pruned
    out = cfg.model_copy(deep=True)
    try:
        out.draft.model = cached_pruned(cfg.draft.model, cfg.draft.head)
    except ValueError as exc:
        raise cfg.error("draft.head", cfg.draft.head, str(exc)) from None
    out.draft.head = None
    return out
