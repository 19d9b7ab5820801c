"""The ONNX export of a Hugging Face `target.model` (`target.backend: onnx`, or `auto` on a CPU), made once, reused.

Entries live in `cache_root()/onnx/NAME-PRECISION-KEY`; KEY hashes `source_stamp` (also the onnxruntime-genai
version), so an edited checkpoint gets a new export and an unchanged one is never exported twice (`build_once`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import numpy as np

from ..draft.export import quant_options, stderr_progress

log = logging.getLogger(__name__)

SOURCE_NAME = "hetero_spec_source.json"  # inside each entry: what it was exported from

# Architectures the onnxruntime-genai model builder exports as decoders (its supported list, text-only
# causal LMs); `target.backend: auto` exports only these and keeps PyTorch for anything else.
EXPORTABLE = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
    "PhiForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GraniteForCausalLM",
    "OlmoForCausalLM", "NemotronForCausalLM", "SmolLM3ForCausalLM", "Ernie4_5ForCausalLM",
    "InternLM2ForCausalLM", "PhiMoEForCausalLM", "GptOssForCausalLM",
})


def cache_root() -> Path:
    """$HETERO_SPEC_CACHE, or ~/.cache/hetero_spec."""
    env = os.environ.get("HETERO_SPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hetero_spec"


def exportable(model_dir: Path) -> tuple[bool, str]:
    """(can the builder export this Hugging Face directory, why not)."""
    try:
        arch = (json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or [None])[0]
    except (OSError, ValueError):
        arch = None
    if arch is None:
        return False, f"{model_dir}/config.json names no architecture"
    if arch not in EXPORTABLE:
        return False, f"the ONNX model builder does not export {arch}"
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return False, f"{model_dir} has no tokenizer.json, which the ONNX model builder needs"
    return True, ""


def source_stamp(model_dir: Path, precision: str, execution_provider: str = "cpu") -> dict:
    """What identifies a checkpoint and its export: path, config, weight files (name, size, mtime), and the
    builder's execution provider when it is not the CPU (the CPU exports' keys predate it)."""
    model_dir = Path(model_dir).resolve()
    try:
        builder = version("onnxruntime-genai")
    except Exception:  # metadata missing: still a stable key
        builder = "?"
    stamp = {"dir": str(model_dir), "precision": precision, "builder": builder,
             "config": json.loads((model_dir / "config.json").read_text()),
             "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(model_dir.iterdir())
                       if p.is_file() and p.suffix in (".safetensors", ".bin", ".json", ".model")]}
    if execution_provider != "cpu":
        stamp["execution_provider"] = execution_provider
    if options := quant_options(precision, stamp["config"]):  # a recipe change re-exports (other keys predate it)
        stamp["quant_options"] = options
    return stamp


def stamp_key(stamp: dict) -> str:
    """A short hash of what identifies a cache entry (its directory name ends with it)."""
    return hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]


def entry_dir(model_dir: Path, precision: str = "fp32", root: Path | None = None,
              execution_provider: str = "cpu") -> Path:
    key = stamp_key(source_stamp(model_dir, precision, execution_provider))
    suffix = "" if execution_provider == "cpu" else f"-{execution_provider}"
    return (root or cache_root()) / "onnx" / f"{Path(model_dir).resolve().name}-{precision}{suffix}-{key}"


def _complete(entry: Path) -> bool:
    return (entry / "model.onnx").is_file() and (entry / SOURCE_NAME).is_file()


def cached_export(model_dir: Path, precision: str = "fp32", root: Path | None = None,
                  progress: Callable[[str], None] | None = None, role: str = "target",
                  execution_provider: str = "cpu") -> Path:
    """The ONNX export of model_dir at `precision` for the builder's `execution_provider` (its `-e`: the graph
    differs per provider; fp16 needs a GPU one), exported now if the cache has none for this checkpoint."""
    from ..draft.export import RUNNER_MODEL, add_runner_graph, export_draft
    entry = entry_dir(model_dir, precision, root, execution_provider)

    def export(scratch: Path, say: Callable[[str], None]) -> None:
        say(f"exporting the {role} {model_dir} to ONNX ({precision}, {execution_provider}) once, into the cache "
            f"{entry} (set HETERO_SPEC_CACHE to move it)")
        export_draft(model_dir, scratch, precision, execution_provider, progress=say)
        (scratch / SOURCE_NAME).write_text(json.dumps(source_stamp(model_dir, precision, execution_provider), indent=2))

    entry = build_once(entry, _complete, export, f"{role}: using the cached ONNX export {entry}", progress)
    if not (entry / RUNNER_MODEL).is_file():  # an entry exported before the runner graph existed
        try:
            with open(entry.parent / f"{entry.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if add_runner_graph(entry):
                    log.info("%s: gave the cached export its runner graph (%s)", role, RUNNER_MODEL)
        except OSError as exc:  # a read-only cache: the export runs as it is (full logits in a prefill)
            log.warning("%s: cannot upgrade the cached export %s: %s", role, entry, exc)
    return entry


#: the block graph's precision (target.block_graph): int8 weights per output column, activations quantized per tensor
#: at run time (ONNX Runtime's DynamicQuantizeMatMul, its u8s8 QGEMM: VNNI, AMX where the CPU has it)
BLOCK_PRECISION = "int8-block-runner"


def cached_block_export(model_dir: Path, root: Path | None = None,
                        progress: Callable[[str], None] | None = None) -> Path:
    """The block graph of model_dir (target.block_graph: int8): its fp32 export (cached_export) with every MatMul's
    weights int8 per column (_quantize_int8), made once and cached. The graph keeps the fp32 export's inputs
    (logits_from too: its LM head runs after the Slice), outputs and KV cache layout, so both sessions share one
    cache."""
    from ..draft.export import RUNNER_MODEL
    fp32 = cached_export(model_dir, "fp32", root, progress)
    entry = entry_dir(model_dir, BLOCK_PRECISION, root)

    def export(scratch: Path, say: Callable[[str], None]) -> None:
        say(f"quantizing the target's fp32 export {fp32} to int8 weights (the block graph) once, into the cache "
            f"{entry}")
        scratch.mkdir(parents=True)
        _quantize_int8(fp32 / RUNNER_MODEL, scratch / "model.onnx")
        for path in fp32.iterdir():  # genai_config.json (the KV shapes), the tokenizer files
            if path.is_file() and not path.name.startswith("model.") and path.name != SOURCE_NAME:
                shutil.copy2(path, scratch / path.name)
        (scratch / SOURCE_NAME).write_text(json.dumps(source_stamp(model_dir, BLOCK_PRECISION), indent=2))

    return build_once(entry, _complete, export, f"target: using the cached block graph {entry}", progress)


def _initializer(tensor, folder: Path):
    """An fp32 export's initializer as a numpy array; one stored in an external data file is mapped, not read."""
    from onnx import helper, numpy_helper
    if tensor.data_location != 1:  # TensorProto.EXTERNAL
        return numpy_helper.to_array(tensor)
    info = {entry.key: entry.value for entry in tensor.external_data}
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return np.memmap(folder / info["location"], dtype=dtype, mode="r", offset=int(info.get("offset", 0)),
                     shape=tuple(tensor.dims))


def external_data_name(dest: Path) -> str:
    """The name of dest's external data file: unique to its folder, because onnx.save_model refuses a name that
    exists relative to the *working directory* (a model.onnx.data where the user runs us would fail the save)."""
    return f"{dest.name}.{dest.parent.name}.data"


def inline_external(tensor, folder: Path) -> None:
    """An initializer stored in an external data file (under folder) read into the tensor itself, as raw bytes, so
    that saving the graph elsewhere writes it to the new graph's own data file (4-bit types too). No-op otherwise."""
    if tensor.data_location != 1:  # TensorProto.EXTERNAL
        return
    info = {entry.key: entry.value for entry in tensor.external_data}
    with open(folder / info["location"], "rb") as data:
        data.seek(int(info.get("offset", 0)))
        tensor.raw_data = data.read(int(info["length"])) if "length" in info else data.read()
    del tensor.external_data[:]
    tensor.data_location = 0  # TensorProto.DEFAULT


def _quantize_int8(src: Path, dest: Path) -> None:
    """src with every MatMul by a 2-D fp32 initializer replaced by ONNX Runtime's DynamicQuantizeMatMul: the weights
    int8 per output column (symmetric: scale = max |w| / 127, zero point 0), the activations quantized at run time.
    One weight at a time is read (mapped from the external data file), so a 1.5B takes about the int8 model's memory,
    not the fp32 one's; the result's weights go to dest's external data file."""
    import onnx
    from onnx import helper, numpy_helper
    model = onnx.load(str(src), load_external_data=False)
    graph, folder = model.graph, Path(src).parent
    weights = {t.name: t for t in graph.initializer}
    users = Counter(name for node in graph.node for name in node.input)
    kept, replaced = [], set()
    for index, node in enumerate(graph.node):
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is None or len(weight.dims) != 2 or weight.data_type != onnx.TensorProto.FLOAT:
            kept.append(node)
            continue
        w = np.asarray(_initializer(weight, folder), dtype=np.float32)
        scale = np.maximum(np.abs(w).max(axis=0), 1e-12) / 127.0
        name = weight.name if users[weight.name] == 1 else f"{weight.name}/{index}"
        graph.initializer.extend([
            numpy_helper.from_array(np.clip(np.rint(w / scale), -127, 127).astype(np.int8), f"{name}/int8"),
            numpy_helper.from_array(scale.astype(np.float32), f"{name}/scale"),
            numpy_helper.from_array(np.zeros(scale.shape, dtype=np.int8), f"{name}/zero_point")])
        kept.append(helper.make_node("DynamicQuantizeMatMul", [node.input[0], f"{name}/int8", f"{name}/scale",
                                                               f"{name}/zero_point"], list(node.output),
                                     name=f"{node.name}/int8", domain="com.microsoft"))
        replaced.add(weight.name)
    unused = replaced - {name for node in kept for name in node.input}
    for tensor in [t for t in graph.initializer if t.name not in unused]:  # the others' data, read now
        inline_external(tensor, folder)
    remaining = [t for t in graph.initializer if t.name not in unused]
    del graph.initializer[:]
    graph.initializer.extend(remaining)
    del graph.node[:]
    graph.node.extend(kept)
    if not any(op.domain == "com.microsoft" for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save_model(model, str(dest), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=external_data_name(Path(dest)), size_threshold=1024)


def build_once(entry: Path, complete: Callable[[Path], bool], build: Callable[[Path, Callable[[str], None]], None],
               found: str, progress: Callable[[str], None] | None = None) -> Path:
    """Make a cache entry once (`found` is logged when it is there already): under a file lock (another process
    may be making the same one), in a scratch folder renamed into place when build(scratch, say) returns, so a
    killed build leaves nothing half-written. `say` is `progress`, or timed lines on stderr."""
    if complete(entry):
        log.info(found)
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f"{entry.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete(entry):
            return entry
        scratch = entry.parent / f"{entry.name}.tmp-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            build(scratch, progress or stderr_progress("hetero-spec"))
            shutil.rmtree(entry, ignore_errors=True)
            scratch.rename(entry)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return entry
