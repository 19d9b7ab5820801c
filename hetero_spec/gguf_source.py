"""GGUF files as model inputs (`target.model`, `draft.model`, `hetero-spec export --model`): converted once by
transformers into an fp32 Hugging Face checkpoint in the cache, keeping every end-of-generation id and the chat
template (docs/getting-started.md). A GGUF draft without draft.precision exports at int4 (fp32 would be 4-8x the
GGUF). The cache key also hashes the transformers version and CONVERTER; metadata is read with gguf's GGUFReader
before anything heavy loads, so a bad file fails at once."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError, ModelLoadError
from .target.export_cache import EXPORTABLE, build_once, cache_root, stamp_key

if TYPE_CHECKING:
    from .config import Config

log = logging.getLogger("hetero_spec.gguf")

CONVERTER = 1  # bump when the conversion's output changes: old cache entries are then not reused
SOURCE_NAME = "hetero_spec_gguf.json"  # inside each entry: what it was converted from, and the EOS ids found
DRAFT_PRECISION = "int4"  # a GGUF draft without draft.precision

# llama.cpp's end-of-generation set (src/llama-vocab.cpp, special_eog_ids), so that both backends stop where it does:
# the ids the file declares for these keys, FIM pad/repo/file-separator (declared, else found by text), and the
# tokens spelt as below wherever the vocabulary has them (llama.cpp takes them whatever their token type).
_EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_FIM_EOG = {"tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
            "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
            "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",)}
_EOG_TEXT = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                       "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                       "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>"})
# transformers' legacy GGUF loader renames these architectures before checking them (load_gguf_checkpoint)
_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
_TEXT_ONLY = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}  # model_type of the text backbone it loads


@dataclass(frozen=True)
class GGUFInfo:
    """What the conversion needs from a GGUF's metadata (general.*, tokenizer.*)."""

    architecture: str
    name: str
    eos_ids: tuple[int, ...]
    chat_template: str | None


def is_gguf(path: Path | str | None) -> bool:
    """Whether a model path names a GGUF file rather than a directory: a `.gguf` name, or any plain file (which
    then has to be a GGUF: the error says so instead of asking for a config.json)."""
    return path is not None and (Path(path).suffix.lower() == ".gguf" or Path(path).is_file())


def read_info(path: Path) -> GGUFInfo:
    """The metadata, read with gguf's GGUFReader (seconds for a large vocabulary: the checks, the conversion and the
    config's preflight share one read of each version of a file). ValueError when the file is not a GGUF."""
    stat = Path(path).stat()
    return _read_info(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_info(path: str, size: int, mtime_ns: int) -> GGUFInfo:
    from gguf import GGUFReader
    fields = GGUFReader(path).fields

    def get(key: str, default=None):
        return fields[key].contents() if key in fields else default

    if get("split.count", 1) > 1:
        raise ValueError(f"it is one of {get('split.count')} split files; merge them first "
                         "(llama-gguf-split --merge FIRST.gguf OUT.gguf)")
    tokens = get("tokenizer.ggml.tokens", [])
    return GGUFInfo(architecture=str(get("general.architecture", "")), name=str(get("general.name", "")),
                    eos_ids=_eog_ids(get, tokens), chat_template=get("tokenizer.chat_template"))


def _eog_ids(get, tokens: list[str]) -> tuple[int, ...]:
    """llama.cpp's end-of-generation ids (see _EOG_TEXT), with its two exceptions: `<|end|>` is not one next to
    `<|return|>`/`<|call|>` (o200k harmony) or `<|calls|>`/`<|flush|>`; `</s>` is not one next to `<|tool_response>`."""
    first = {text: i for i, text in reversed(list(enumerate(tokens)))}  # each text's first id
    declared = [get(key) for key in _EOG_KEYS]
    # FIM pad/repo/file-separator: declared, else found by text
    declared += [get(k, min((first[n] for n in names if n in first), default=None)) for k, names in _FIM_EOG.items()]
    ids = {int(i) for i in declared if i is not None} | {first[t] for t in _EOG_TEXT if t in first}
    texts = {tokens[i] for i in ids if i < len(tokens)}
    if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts):
        ids.discard(first["<|end|>"])
    if "</s>" in texts and "<|tool_response>" in texts:
        ids.discard(first["</s>"])
    return tuple(sorted(ids))


def convertible() -> set[str]:
    """The GGUF architectures (general.architecture) this transformers converts: its legacy loader's list and the
    newer integrations/gguf path's."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    archs = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}  # keys of its mapping, not architectures
    with contextlib.suppress(ImportError):  # older transformers: the legacy loader only
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
        archs |= set(GGUF_CONFIG_ARCHS)
    return archs


def hf_architecture(info: GGUFInfo) -> str | None:
    """The Hugging Face class the conversion will write (config.json's architectures), when known without loading;
    "" when the model type is not a causal LM (t5, umt5)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    model_type = _RENAMED.get(info.architecture, info.architecture)
    if model_type == "llama" and "mistral" in info.name:  # as transformers reads llama.cpp's Mistral files
        model_type = "mistral"
    model_type = _TEXT_ONLY.get(model_type, model_type)
    if model_type not in GGUF_SUPPORTED_ARCHITECTURES and model_type not in _TEXT_ONLY.values():
        return None  # the newer loader's architectures: their config is built on load
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "")


def check(path: Path, source: str, key: str, onnx: bool = False) -> None:
    """Fail now, before anything heavy loads, with a ConfigError (source, key, value) on a GGUF that cannot be converted
    (or, with onnx, exported): missing, not a GGUF, or an architecture transformers (or the ONNX model builder) does not
    handle. A file already converted is not read again (export_cache.exportable checks its conversion's export)."""
    path = Path(path)
    bad = functools.partial(ConfigError, source, key, str(path))  # bad(why)
    if not path.is_file():
        raise bad("GGUF file not found" if not path.is_dir() else
                  "a directory named .gguf: give the GGUF file, or a Hugging Face model directory")
    if _complete(entry_dir(path)):
        return
    try:
        info = read_info(path)
    except ImportError as exc:
        raise bad(f"reading a GGUF needs the gguf extra ({exc}): pip install 'hetero-spec[gguf]'") from None
    except Exception as exc:  # GGUFReader: ValueError for a bad magic; a truncated file raises others
        raise bad(f"not a GGUF file that can be read: {exc}") from None
    arch, archs = f"general.architecture {info.architecture!r}", convertible()
    if info.architecture not in archs and _RENAMED.get(info.architecture) not in archs:
        raise bad(f"{arch}: transformers cannot convert this GGUF architecture to a Hugging Face checkpoint "
                  f"(it converts: {', '.join(sorted(archs))})")
    cls = hf_architecture(info)
    if cls == "":
        raise bad(f"{arch} is not a decoder-only causal language model")
    if onnx and cls is not None and cls not in EXPORTABLE:
        raise bad(f"{arch} converts to {cls}, which the ONNX model builder does not export"
                  f"{'; use target.backend: torch' if key == 'target.model' else ''}")


def source_stamp(path: Path) -> dict:
    """What identifies a GGUF and its conversion, cheaply: the file's path, size and mtime, and the converter."""
    from importlib.metadata import version
    path = Path(path).resolve()
    stat = path.stat()
    return {"gguf": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "transformers": version("transformers"), "converter": CONVERTER}


def entry_dir(path: Path) -> Path:
    return cache_root() / "gguf-hf" / f"{Path(path).resolve().stem}-{stamp_key(source_stamp(path))}"


def _complete(entry: Path) -> bool:
    return (entry / "config.json").is_file() and (entry / SOURCE_NAME).is_file()


def cached_hf(path: Path, source: str = "<config>", key: str = "target.model", onnx: bool = False) -> Path:
    """The Hugging Face directory converted from the GGUF at path, converted now if the cache has none for it."""
    path = Path(path)
    check(path, source, key, onnx)
    entry = entry_dir(path)

    def convert(scratch: Path, say: Callable[[str], None]) -> None:
        say(f"converting {path.name} to a Hugging Face checkpoint once, into the cache {entry} "
            "(set HETERO_SPEC_CACHE to move it)")
        start = time.monotonic()
        _convert(path, scratch, read_info(path), say, f"{source}: {key} = {str(path)!r}")
        say(f"converted in {time.monotonic() - start:.1f} s")

    return build_once(entry, _complete, convert, f"{key}: using the cached conversion {entry} of {path}")


def _convert(path: Path, out: Path, info: GGUFInfo, say: Callable[[str], None], where: str) -> None:
    """Load the GGUF with transformers (fp32, dequantized), save it as safetensors with its tokenizer, every EOS id
    (generation_config.json) and the chat template; then the source stamp, which marks the entry complete."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        say("loading the GGUF and dequantizing its weights to fp32")
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     low_cpu_mem_usage=True, **_dequantized())
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ImportError as exc:
        raise ModelLoadError(f"{where}: converting a GGUF needs the gguf extra ({exc}); "
                             "pip install 'hetero-spec[gguf]' (gguf, accelerate)") from None
    except Exception as exc:  # transformers' loader: a corrupt or unusual file
        raise ModelLoadError(f"{where}: transformers could not load this GGUF: {type(exc).__name__}: {exc}") from exc
    # the weights are plain fp32 tensors already, but a GGUF quantizer left on the model makes save_pretrained
    # raise "quantized with gguf and is not serializable"
    model.hf_quantizer = None
    vars(model.config).pop("quantization_config", None)
    if info.eos_ids:
        model.generation_config.eos_token_id = list(info.eos_ids)
    say(f"writing safetensors ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters), the tokenizer "
        f"and the EOS ids {list(info.eos_ids)}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if info.chat_template and not (out / "chat_template.jinja").is_file():
        (out / "chat_template.jinja").write_text(info.chat_template)
    if not (out / "tokenizer.json").is_file():
        raise ModelLoadError(f"{where}: the converted tokenizer wrote no tokenizer.json (the ONNX builder and the "
                             "vocabulary check need one)")
    stamp = {**source_stamp(path), "architecture": info.architecture, "eos_token_id": list(info.eos_ids)}
    (out / SOURCE_NAME).write_text(json.dumps(stamp, indent=2))


def _dequantized() -> dict:
    """from_pretrained's option that dequantizes every weight: newer transformers may otherwise keep some GGUF
    blocks packed (GgufLinear), which save_pretrained cannot write."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}



def resolve(cfg: Config) -> Config:
    """cfg with each GGUF target.model (and draft.model of an onnx draft) replaced by its Hugging Face conversion,
    made now or found in the cache. Every GGUF is checked before the first converts. A GGUF draft without
    draft.precision is exported at DRAFT_PRECISION. cfg itself when it names no GGUF."""
    draft_model = cfg.draft.model if cfg.draft.kind == "onnx" else None
    ggufs = {k: m for k, m in (("target.model", cfg.target.model), ("draft.model", draft_model)) if is_gguf(m)}
    if not ggufs:
        return cfg
    onnx = {"target.model": cfg.target.backend == "onnx", "draft.model": True}
    for key, model in ggufs.items():
        check(model, cfg.blame(key), key, onnx[key])
    out = cfg.model_copy(deep=True)
    for key, model in ggufs.items():
        (out.target if key == "target.model" else out.draft).model = cached_hf(model, cfg.blame(key), key, onnx[key])
    if "draft.model" in ggufs and out.draft.precision is None:
        out.draft.precision = DRAFT_PRECISION
        log.info("draft.model is a GGUF and draft.precision is unset: exporting the draft at %s", DRAFT_PRECISION)
    return out
