"""Hugging Face checkpoint -> ONNX draft with a KV cache, via onnxruntime-genai's model builder.

The builder does the export and the quantization (fp32, fp16, int8, int4). It runs in a subprocess:
it imports torch and transformers, which the draft side never does itself.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import HeteroSpecError

PRECISIONS = ("fp32", "fp16", "int8", "int4")
PROVIDERS = ("cpu", "cuda", "dml", "webgpu", "NvTensorRtRtx", "qnn")


class ExportError(HeteroSpecError):
    """The model builder could not export the checkpoint."""


def export_draft(model_dir: str | Path, out_dir: str | Path, precision: str = "fp32",
                 execution_provider: str = "cpu", quiet: bool = False, block_size: int | None = None) -> Path:
    """Export model_dir (a HF decoder directory with tokenizer.json) to out_dir/model.onnx.

    block_size: quantization block of int4/int8 weights (16/32/64/128/256; the builder's default is 32).
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if precision not in PRECISIONS:
        raise ExportError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if execution_provider not in PROVIDERS:
        raise ExportError(f"--execution-provider {execution_provider!r}: choose one of {', '.join(PROVIDERS)}")
    if not (model_dir / "config.json").is_file():
        raise ExportError(f"--model {str(model_dir)!r}: not a Hugging Face model directory (no config.json)")
    if not (model_dir / "tokenizer.json").is_file():
        raise ExportError(f"--model {str(model_dir)!r}: no tokenizer.json; the builder needs one "
                          "(save a PreTrainedTokenizerFast with save_pretrained into the directory)")
    arch = json.loads((model_dir / "config.json").read_text()).get("architectures", ["?"])
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hetero-spec-export-") as cache:
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(model_dir),
               "-o", str(out_dir), "-p", precision, "-e", execution_provider, "-c", cache]
        if block_size is not None:
            if block_size not in (16, 32, 64, 128, 256):
                raise ExportError(f"--block-size {block_size}: choose one of 16, 32, 64, 128, 256")
            cmd += ["--extra_options", f"block_size={block_size}"]
        proc = subprocess.run(cmd, capture_output=quiet, text=True)
    if proc.returncode != 0 or not (out_dir / "model.onnx").is_file():
        tail = (proc.stderr or "")[-2000:] if quiet else "(see the builder's output above)"
        raise ExportError(f"onnxruntime-genai builder failed for {str(model_dir)!r} "
                          f"(architecture {arch[0]}, precision {precision}): {tail}")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the drafter checks the vocabulary with it
        if (model_dir / name).is_file() and not (out_dir / name).is_file():
            shutil.copy(model_dir / name, out_dir / name)
    return out_dir
