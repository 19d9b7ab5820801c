"""Hugging Face checkpoint -> ONNX draft with a KV cache, via onnxruntime-genai's model builder, which exports
and quantizes (fp32, fp16, int8, int4) in a subprocess: it imports torch and transformers, which the draft side
never does. Its full output goes to OUT/export.log; the user sees one progress line per stage."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import HeteroSpecError

PRECISIONS = ("fp32", "fp16", "int8", "int4")
PROVIDERS = ("cpu", "cuda", "dml", "webgpu", "NvTensorRtRtx", "qnn")
LOG_NAME = "export.log"  # the builder's full output, inside the output directory
#: the graph our runner loads (OnnxDecoder prefers it): model.onnx with the inputs `logits_from` (add_logits_from)
#: and, where its attention allows, `position_ids` and `attention_bias` (add_tree_inputs); next to model.onnx and
#: reading the same weights file
RUNNER_MODEL = "model.runner.onnx"

# Builder output that starts a stage worth a progress line (substring -> what the user reads), in the builder's
# order; each is shown once. Cosmetic only: a builder that words them otherwise just shows fewer stages.
_STAGES = (
    ("Loading weights", "loading the checkpoint's weights"),
    ("Reading ", "building the ONNX graph, layer by layer"),
    ("Saving ONNX model", "writing model.onnx"),
    ("quantiz", "quantizing weights"),
    ("Saving GenAI config", "writing genai_config.json and the tokenizer files"),
)


class ExportError(HeteroSpecError):
    """The model builder could not export the checkpoint."""


def export_draft(model_dir: str | Path, out_dir: str | Path, precision: str = "fp32",
                 execution_provider: str = "cpu", quiet: bool = False, block_size: int | None = None,
                 progress: Callable[[str], None] | None = None) -> Path:
    """Export model_dir (a HF decoder directory with tokenizer.json) to out_dir/model.onnx. block_size: of int4/int8
    weights (default: `quant_options`). progress gets one line per stage (default: stderr, unless quiet)."""
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
    if block_size is not None and block_size not in (16, 32, 64, 128, 256):
        raise ExportError(f"--block-size {block_size}: choose one of 16, 32, 64, 128, 256")
    hf_config = json.loads((model_dir / "config.json").read_text())
    arch = hf_config.get("architectures", ["?"])
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / LOG_NAME
    before = _mtime(out_dir / "model.onnx")  # a model left by an earlier export must not pass for this one
    say = progress or ((lambda text: None) if quiet else stderr_progress())
    with tempfile.TemporaryDirectory(prefix="hetero-spec-export-") as cache:
        src, extra = _sliding_window_source(model_dir, hf_config, Path(cache))
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src),
               "-o", str(out_dir), "-p", precision, "-e", execution_provider, "-c", cache]
        extra += quant_options(precision, hf_config, block_size)
        if extra:
            cmd += ["--extra_options", *extra]
        status = _run_builder(cmd, log_path, say)
    if status != 0 or _mtime(out_dir / "model.onnx") in (None, before):
        raise ExportError(f"onnxruntime-genai builder failed for {str(model_dir)!r} (architecture {arch[0]}, "
                          f"precision {precision}, exit code {status}); full log: {log_path}; its end:\n"
                          f"{_tail(log_path)}")
    # the drafter checks the vocabulary with the tokenizer; the server renders chats with the template
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (model_dir / name).is_file() and not (out_dir / name).is_file():
            shutil.copy(model_dir / name, out_dir / name)
    add_runner_graph(out_dir)
    return out_dir


def add_runner_graph(out_dir: Path) -> bool:
    """Write RUNNER_MODEL beside model.onnx (the weights file is shared): model.onnx with add_logits_from and
    add_tree_inputs. model.onnx stays as the builder wrote it, for onnxruntime-genai (which never feeds them). False
    when it is there already or the graph has no `logits`."""
    import onnx
    path, dest = Path(out_dir) / "model.onnx", Path(out_dir) / RUNNER_MODEL
    if dest.is_file():
        return False
    model = onnx.load(str(path), load_external_data=False)
    if not add_logits_from(model.graph):
        return False
    add_tree_inputs(model.graph)
    tmp = dest.with_suffix(".tmp")
    onnx.save(model, str(tmp))
    os.replace(tmp, dest)
    return True


#: the inputs add_tree_inputs gives a graph
TREE_INPUTS = ("position_ids", "attention_bias")


def add_tree_inputs(graph) -> bool:
    """Give every GroupQueryAttention its optional inputs `position_ids` (int64 [batch, seq]: each token's rotary
    position) and `attention_bias` ([batch, 1, seq, total], added to the attention scores), as graph inputs of those
    names, so that one pass can verify a token tree: tokens at the same depth share a position, and each sees only
    its ancestors (OnnxDecoder.append_tree). False (graph unchanged) where the graph has other attention, already
    takes a `position_ids`, or its attention uses those inputs already."""
    from onnx import TensorProto, helper
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    taken = {i.name for i in graph.input} & set(TREE_INPUTS)
    if not attention or taken or any(len(n.input) > 9 and any(n.input[9:11]) for n in attention):
        return False
    past = next((i for i in graph.input if i.name.startswith("past_key_values.")), None)
    dtype = past.type.tensor_type.elem_type if past is not None else TensorProto.FLOAT
    graph.input.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]))
    graph.input.append(helper.make_tensor_value_info("attention_bias", dtype,
                                                     ["bias_batch", 1, "sequence_length", "total_sequence_length"]))
    for node in attention:
        inputs = list(node.input) + [""] * max(0, 11 - len(node.input))
        inputs[9], inputs[10] = TREE_INPUTS
        del node.input[:]
        node.input.extend(inputs)
    return True


def add_logits_from(graph) -> bool:
    """Give the graph an input `logits_from` (int64 [1]): the LM head runs on the positions from there on
    (a Slice of its input), so a prefill of n tokens computes one row of logits, not n (OnnxDecoder feeds n - 1;
    a verification 0). On the real 1.5B target the LM head was 330 ms of a 2.05 s prefill of 118 tokens. False
    (graph unchanged) where there is no `logits`."""
    from onnx import TensorProto, helper
    head = next((n for n in graph.node if "logits" in n.output), None)
    out = next((o for o in graph.output if o.name == "logits"), None)
    if head is None or out is None:
        return False
    sliced = f"{head.input[0]}/logits_from"
    graph.initializer.extend([helper.make_tensor("logits_from/ends", TensorProto.INT64, [1], [2 ** 62]),
                              helper.make_tensor("logits_from/axes", TensorProto.INT64, [1], [1])])
    graph.input.append(helper.make_tensor_value_info("logits_from", TensorProto.INT64, [1]))
    graph.node.insert(list(graph.node).index(head), helper.make_node(
        "Slice", [head.input[0], "logits_from", "logits_from/ends", "logits_from/axes"], [sliced],
        name="/lm_head/logits_from/Slice"))
    head.input[0] = sliced
    out.type.tensor_type.shape.dim[1].dim_param = "logits_length"
    return True


#: what the recipe quantizes beyond the builder's defaults (part of the export cache's key): int4 also quantizes an
#: untied embedding table (GatherBlockQuantized), which stayed fp32 (0.93 GB of a 1.5B's 1.8 GB int4 export). A
#: decode step reads one row of it, so this shrinks the export and its memory, not the bytes a token reads.
QUANT_OPTIONS = {"int4": ["op_types_to_quantize=MatMul/Gather"]}
#: int4's quantization block where the hidden size allows it (the builder's default is 32). On the real 1.5B
#: target: 0.96 GB instead of 1.13 (an fp32 scale per 128 weights, not per 32), a decode step 1.28x faster
#: (20.8 against 16.2 tok/s, 2 threads, interleaved), and a mean KL from the dequantized GGUF of 0.014 nats
#: instead of 0.006 (top-1 agreement 187 against 188 of 192 tokens). `--block-size` still sets any block.
INT4_BLOCK = 128


def quant_options(precision: str, config: dict | None = None, block_size: int | None = None) -> list[str]:
    """The builder's extra options this recipe adds for a precision and a checkpoint's config.json."""
    opts = list(QUANT_OPTIONS.get(precision, []))
    if block_size is None and precision == "int4" and config:
        hidden = int(config.get("hidden_size") or 0)
        block_size = INT4_BLOCK if hidden and hidden % INT4_BLOCK == 0 else None  # narrower models: 32
    if block_size is not None:
        opts.append(f"block_size={block_size}")
    return opts


def _sliding_window_source(model_dir: Path, cfg: dict, scratch: Path) -> tuple[Path, list[str]]:
    """(directory to export, builder extra options) keeping a sliding window exactly as transformers does.
    The builder reads the window from `layer_types`, which some configs (Mistral) leave out (the export would
    attend to the whole context): a scratch copy spells it out. `windowed_kv_cache=false`: a full-length cache
    with the window applied in attention (the drafter's sliced cache cannot drive the default ring buffer). cfg:
    model_dir's config.json."""
    if not cfg.get("sliding_window") or cfg.get("use_sliding_window") is False:
        return model_dir, []
    if cfg.get("layer_types"):
        return model_dir, ["windowed_kv_cache=false"]
    src = scratch / "source"
    src.mkdir()
    for path in model_dir.iterdir():  # links: the weights are not copied
        if path.name != "config.json":
            (src / path.name).symlink_to(path.resolve())
    layer_types = ["sliding_attention"] * int(cfg["num_hidden_layers"])
    (src / "config.json").write_text(json.dumps({**cfg, "layer_types": layer_types}, indent=2))
    return src, ["windowed_kv_cache=false"]


def _mtime(path: Path) -> int | None:
    return path.stat().st_mtime_ns if path.is_file() else None


def stderr_progress(prefix: str = "export") -> Callable[[str], None]:
    """A progress callback printing timed lines on stderr: `PREFIX [  1.2 s] text`."""
    start = time.monotonic()
    return lambda text: print(f"{prefix} [{time.monotonic() - start:5.1f} s] {text}", file=sys.stderr, flush=True)


def _run_builder(cmd: list[str], log_path: Path, say: Callable[[str], None]) -> int:
    """Run the builder with all its output into log_path; say() one line per stage. Returns the exit code."""
    say("starting the model builder (it imports torch and transformers first)")
    shown = 0
    # unbuffered: stages arrive as they happen, not at exit
    with open(log_path, "w", encoding="utf-8") as log, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, encoding="utf-8",
            errors="replace", env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        log.write(f"$ {shlex.join(cmd)}\n")
        for line in proc.stdout:  # tqdm's \r updates arrive as lines too (universal newlines)
            log.write(line)
            stage = next((i for i in range(shown, len(_STAGES)) if _STAGES[i][0] in line), None)
            if stage is not None:
                shown = stage + 1
                say(_STAGES[stage][1])
        status = proc.wait()
    say("done" if status == 0 else f"the builder failed (exit code {status})")
    return status


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(cannot read the log: {exc})"
