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


def choose_backend(t, source: str = "<config>") -> BackendChoice:
    """Resolve `target.backend` (t: the TargetConfig)."""
    is_export = (Path(t.model) / "model.onnx").is_file()
    if t.backend != "auto":
        return BackendChoice(t.backend, "set by target.backend")
    if _device_is_cuda(t.device):
        if is_export:
            raise ConfigError(source, "target.model", str(t.model),
                              "target.backend auto picks torch for a CUDA device, which needs a Hugging Face "
                              "directory, but this is an ONNX export; set target.backend: onnx with "
                              "target.providers: [CUDAExecutionProvider], or point target.model at the checkpoint")
        return BackendChoice("torch", f"the target's device is CUDA ({t.device})")
    if is_export:
        return BackendChoice("onnx", "CPU target and target.model is an ONNX export")
    ok, why = exportable(Path(t.model))
    if ok:
        return BackendChoice("onnx", "CPU target: ONNX Runtime's kernels beat eager PyTorch there")
    return BackendChoice("torch", f"CPU target, but {why}")


def precision_of(t) -> str:
    """target.precision, else its alias target.dtype (auto: fp32 here; the Engine resolves auto per device)."""
    return t.precision if t.precision is not None else {"float16": "fp16", "bfloat16": "bf16"}.get(t.dtype, "fp32")


#: the model builder's `-e` for the first of target.providers (the graph it writes differs per provider)
BUILDER_EP = {"CPUExecutionProvider": "cpu", "CUDAExecutionProvider": "cuda", "DmlExecutionProvider": "dml",
              "WebGpuExecutionProvider": "webgpu", "NvTensorRTRTXExecutionProvider": "NvTensorRtRtx",
              "QNNExecutionProvider": "qnn"}


def builder_ep(providers: list[str] | None) -> str:
    return BUILDER_EP.get((providers or ["CPUExecutionProvider"])[0], "cpu")


def onnx_model_dir(t, source: str = "<config>") -> Path:
    """The ONNX directory the onnx backend loads: target.model itself, or its cached export at the precision,
    for the builder's provider matching target.providers (checked first: an export takes minutes)."""
    model = Path(t.model)
    if (model / "model.onnx").is_file():
        return model
    if t.providers:
        from ..onnx_decoder import check_providers
        check_providers(t.providers, source, key="target.providers")
    return cached_export(model, precision_of(t), execution_provider=builder_ep(t.providers))


def load_target(t, threads: int | None, spin: bool | str = True, prefill_threads: int | None = None):
    """The verifier for a resolved backend (t.backend is torch or onnx). spin: target.spin (OnnxDecoder). prefill_threads: onnx backend,
    the prompt's prefill on that many threads (a second session; None or <= threads: none)."""
    if t.backend == "onnx":
        from .onnx_backend import OnnxTarget
        return OnnxTarget(onnx_model_dir(t), providers=t.providers, threads=threads, max_context=t.max_context,
                          spin=spin, prefill_threads=prefill_threads)
    from .verifier import TargetModel
    p = precision_of(t) if t.precision is not None else None
    dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "float32"}.get(p, t.dtype)
    return TargetModel(t.model, device=t.device, dtype=dtype, threads=threads, max_context=t.max_context,
                       quantize="int8" if p == "int8" else None, kv_cache_dtype=t.kv_cache_dtype)
