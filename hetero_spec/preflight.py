"""Preflight: a config checked before anything heavy loads (the target takes seconds to minutes): model paths,
the worker's TCP bind address and keys, the draft's execution providers and vocabulary. Each failure is an
error naming the source, the key and the value."""

from pathlib import Path

from .config import Config
from .errors import VocabMismatchError
from .gguf_source import check as check_gguf, is_gguf
from .target.export_cache import exportable


def check_config(cfg: Config) -> None:
    """Everything check_paths checks, then the worker's link and the onnx draft against the target."""
    check_paths(cfg)
    runtime = cfg.runtime
    if runtime.mode != "in_process" and runtime.transport == "tcp":
        from .transport.channel import check_bind_host
        if why := check_bind_host(runtime.host, runtime.curve_keys is not None):
            raise cfg.error("runtime.host", runtime.host, why)
    if runtime.kernels == "hetero_spec":
        from .kernels import unsupported
        if why := unsupported():
            raise cfg.error("runtime.kernels", runtime.kernels, f"hetero_spec's 4-bit block kernel {why}; "
                            "runtime.kernels auto or onnxruntime runs ONNX Runtime's MatMulNBits")
    if runtime.worker == "remote":
        _check_remote(cfg)
    elif runtime.mode != "in_process" and runtime.curve_keys is not None:
        from .transport.channel import CurveKeys
        try:
            CurveKeys.load(runtime.curve_keys)
        except (OSError, ValueError) as exc:
            raise cfg.error("runtime.curve_keys", str(runtime.curve_keys), f"cannot read the CURVE keys ({exc}); "
                            "make them with `hetero-spec keys --out DIR`") from None
    if cfg.draft.kind == "onnx" and runtime.worker == "spawn":
        from .onnx_decoder import check_providers
        check_providers(cfg.draft.providers, source=cfg.blame("draft.providers"))
        check_vocab(cfg.target.model, cfg.draft.model, source=cfg.blame("draft.model"))


def _check_remote(cfg: Config) -> None:
    """runtime.worker remote: the worker connects over TCP with CURVE to a fixed port, and the target admits
    the keys it has."""
    runtime = cfg.runtime
    if runtime.mode != "two_process":
        raise cfg.error("runtime.worker", "remote", f"needs runtime.mode: two_process (got {runtime.mode!r})")
    if runtime.transport != "tcp" or not runtime.port:
        key = "port" if runtime.transport == "tcp" else "transport"  # the one at fault
        raise cfg.error(f"runtime.{key}", getattr(runtime, key), "runtime.worker remote needs runtime.transport: tcp "
                        "and a fixed runtime.port for workers to connect to")
    if runtime.curve_keys is None:
        raise cfg.error("runtime.curve_keys", None, "runtime.worker remote needs the target's CURVE keys "
                        "(`hetero-spec keys --out DIR`)")
    from .transport.channel import admitted_keys
    try:
        admitted_keys(runtime.curve_keys, runtime.worker_keys)
    except (OSError, ValueError) as exc:
        key = "runtime.worker_keys" if runtime.worker_keys else "runtime.curve_keys"
        raise cfg.error(key, str(runtime.worker_keys or runtime.curve_keys), f"cannot read the keys ({exc})") from None


def check_paths(cfg: Config) -> None:
    """Model directories (or GGUF files: their metadata) must exist, and the modes fit together."""
    draft = cfg.draft
    if cfg.runtime.mode == "two_process" and draft.kind != "onnx":
        raise cfg.error("runtime.mode", cfg.runtime.mode, f"two_process needs draft.kind: onnx (got {draft.kind!r}); "
                        "use runtime.mode: in_process for ngram or none")
    if "onnx" in draft.candidates and draft.kind != "onnx":
        raise cfg.error("draft.candidates", draft.candidates,
                        "onnx among the candidates needs draft.kind: onnx and draft.model")
    if len(set(draft.candidates)) != len(draft.candidates):
        raise cfg.error("draft.candidates", draft.candidates, "each strategy may appear once")
    if cfg.target.model is None:
        raise cfg.error("target.model", None, "a target model directory is required")
    if is_gguf(cfg.target.model):  # converted to a Hugging Face directory by gguf_source.resolve
        check_gguf(cfg.target.model, cfg.blame("target.model"), "target.model", onnx=cfg.target.backend == "onnx")
    else:
        _check_target_dir(cfg)
    if draft.kind != "onnx" or cfg.runtime.worker == "remote":  # a remote worker loads its model on its own host
        return
    if draft.model is None:
        raise cfg.error("draft.model", None, "draft.kind is onnx, so a draft model is required")
    if is_gguf(draft.model):
        check_gguf(draft.model, cfg.blame("draft.model"), "draft.model", onnx=True)
    elif not (draft.model / "model.onnx").is_file() and not (draft.model / "config.json").is_file():
        raise cfg.error("draft.model", str(draft.model), "no model.onnx in this directory (make one with "
                        "`hetero-spec export`), nor a Hugging Face checkpoint (config.json) to export at "
                        "draft.precision")


def _check_target_dir(cfg: Config) -> None:
    """target.model as a directory: a Hugging Face checkpoint, or an export the backend can run."""
    model = cfg.target.model
    is_export = (model / "model.onnx").is_file()
    if cfg.target.backend == "torch" and is_export:
        raise cfg.error("target.model", str(model),
                        "this is an ONNX export, which target.backend torch cannot run; set target.backend: "
                        "onnx (or auto), or point target.model at the Hugging Face checkpoint")
    if not is_export and not (model / "config.json").is_file():
        raise cfg.error("target.model", str(model), "not a Hugging Face model directory (no config.json found)")
    if cfg.target.backend == "onnx" and not is_export:
        can_export, why = exportable(model)
        if not can_export:
            raise cfg.error("target.model", str(model), f"target.backend onnx needs an ONNX export of the target, "
                            f"but {why}; use target.backend: torch (or auto)")


def _tokenizer_vocab(model_dir: Path) -> dict[str, int] | None:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


def check_vocab(target_dir: Path, draft_dir: Path, source: str = "<config>") -> None:
    """The draft must emit the same token ids as the target: the same tokenizer vocabulary (logit widths may differ:
    transformers pads some vocabularies). A draft directory without a tokenizer.json is not checked (trusted)."""
    target_vocab, draft_vocab = _tokenizer_vocab(target_dir), _tokenizer_vocab(draft_dir)
    if target_vocab is None or draft_vocab is None or target_vocab == draft_vocab:
        return
    raise VocabMismatchError(f"{source}: draft.model = {str(draft_dir)!r}: its tokenizer differs from the one of "
                             f"target.model ({target_dir}): {_vocab_diff(target_vocab, draft_vocab)}; the draft "
                             "must use the target's tokenizer")


def _vocab_diff(target: dict[str, int], draft: dict[str, int], examples: int = 3) -> str:
    """Sizes when they differ, then the first few tokens (by target id) whose ids differ."""
    out = [] if len(target) == len(draft) else [f"the target's has {len(target)} tokens, the draft's {len(draft)}"]
    diffs = [f"token {tok!r} is id {i} in the target's tokenizer but "
             + ("missing from the draft's" if draft.get(tok) is None else f"id {draft[tok]} in the draft's")
             for tok, i in sorted(target.items(), key=lambda kv: kv[1]) if draft.get(tok) != i]
    diffs += [f"token {tok!r} is id {j} in the draft's tokenizer but missing from the target's"
              for tok, j in sorted(draft.items(), key=lambda kv: kv[1]) if tok not in target]
    if diffs:
        out.append(f"{len(diffs)} tokens differ, e.g. " + "; ".join(diffs[:examples]))
    return "; ".join(out)
