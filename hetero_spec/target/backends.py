"""Which verifier backend runs the target (`target.backend`: torch, onnx or auto; docs/architecture.md#target-backends),
and loading it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .export_cache import cached_export, exportable


@dataclass(frozen=True)
class BackendChoice:
    backend: str  # torch | onnx
    reason: str


def _device_is_cuda(device: str) -> bool:
    if device == "cpu":
        return False
    if device.startswith("cuda"):
        return True
    try:  # device: auto; only torch can tell whether a CUDA device is there
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def choose_backend(cfg, source: str = "<config>") -> BackendChoice:
    """Resolve `target.backend` (cfg: the TargetConfig)."""
    is_export = (Path(cfg.model) / "model.onnx").is_file()
    if cfg.backend != "auto":
        return BackendChoice(cfg.backend, "set by target.backend")
    if _device_is_cuda(cfg.device):
        if is_export:
            raise ConfigError(source, "target.model", str(cfg.model),
                              "target.backend auto picks torch for a CUDA device, which needs a Hugging Face "
                              "directory, but this is an ONNX export; set target.backend: onnx with "
                              "target.providers: [CUDAExecutionProvider], or point target.model at the checkpoint")
        return BackendChoice("torch", f"the target's device is CUDA ({cfg.device})")
    if is_export:
        return BackendChoice("onnx", "CPU target and target.model is an ONNX export")
    can_export, why = exportable(Path(cfg.model))
    return (BackendChoice("onnx", "CPU target: ONNX Runtime's kernels beat eager PyTorch there") if can_export
            else BackendChoice("torch", f"CPU target, but {why}"))


def precision_of(cfg) -> str:
    """target.precision, else its alias target.dtype (auto: fp32 here; the Engine resolves auto per device)."""
    return cfg.precision or {"float16": "fp16", "bfloat16": "bf16"}.get(cfg.dtype, "fp32")


#: the model builder's `-e` for the first of target.providers (the graph it writes differs per provider)
BUILDER_EP = {"CPUExecutionProvider": "cpu", "CUDAExecutionProvider": "cuda", "DmlExecutionProvider": "dml",
              "WebGpuExecutionProvider": "webgpu", "NvTensorRTRTXExecutionProvider": "NvTensorRtRtx",
              "QNNExecutionProvider": "qnn"}


def builder_ep(providers: list | None) -> str:
    from ..config import provider_name
    return BUILDER_EP.get(provider_name(providers[0]) if providers else "CPUExecutionProvider", "cpu")


def onnx_model_dir(cfg) -> Path:
    """The ONNX directory the onnx backend loads: target.model itself, or its cached export at the precision,
    for the builder's provider matching target.providers (checked first: an export takes minutes)."""
    model = Path(cfg.model)
    if (model / "model.onnx").is_file():
        return model
    if cfg.providers:
        from ..onnx_decoder import check_providers
        check_providers(cfg.providers, key="target.providers")
    return cached_export(model, precision_of(cfg), execution_provider=builder_ep(cfg.providers))


def target_spin(config) -> bool | str:
    """target.spin, auto resolved: `run` where an ONNX draft model runs in this process beside the target, else
    true (runtime.mode auto counts as in process: the placement's probes run both side by side)."""
    if (spin := config.target.spin) != "auto":
        return spin
    kinds = config.draft.candidates or [config.draft.kind]
    return "run" if "onnx" in kinds and config.runtime.mode != "two_process" else True


def load_target(cfg, threads: int | None, spin: bool | str = True, prefill_threads: int | None = None,
                kernels: str = "onnxruntime"):
    """The verifier for a resolved backend (cfg: the TargetConfig; its backend is torch or onnx). spin: target.spin
    (OnnxDecoder). prefill_threads: onnx backend, the prompt's prefill on that many threads (a second session; None or
    <= threads: none). kernels: runtime.kernels (onnx backend)."""
    if cfg.backend == "onnx":
        from .onnx_backend import OnnxTarget
        block = None
        if cfg.block_graph == "int8":
            from .export_cache import cached_block_export
            block = cached_block_export(cfg.model)
        return OnnxTarget(onnx_model_dir(cfg), providers=cfg.providers, threads=threads, max_context=cfg.max_context,
                          spin=spin, prefill_threads=prefill_threads, block_dir=block, kernels=kernels)
    from .verifier import TargetModel
    dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "float32"}.get(cfg.precision, cfg.dtype)
    return TargetModel(cfg.model, device=cfg.device, dtype=dtype, threads=threads, max_context=cfg.max_context,
                       quantize="int8" if cfg.precision == "int8" else None, kv_cache_dtype=cfg.kv_cache_dtype)
