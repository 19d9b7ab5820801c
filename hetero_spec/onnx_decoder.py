"""One runner for a decoder exported by onnxruntime-genai's model builder, with a rollback-able KV cache.

Used by the ONNX drafter and by the ONNX target backend. Imports onnxruntime and numpy, never torch.

The exported model's inputs are `input_ids`, `attention_mask` (total length), optionally `position_ids`,
and `past_key_values.N.key/value` [batch, kv_heads, past, head_dim]; its outputs are `logits` and
`present.N.key/value`. The runner is stateless: each request's cache lives in a `DecoderState`, so one
loaded model can serve several requests. Rolling back is slicing the past along its third axis (the
arrays are never changed in place, so a slice is free and an older state stays valid).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .errors import ConfigError, ModelLoadError

_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def check_providers(providers: list[str], source: str = "<config>", key: str = "draft.providers") -> None:
    """Every requested execution provider must exist in this onnxruntime build."""
    available = ort.get_available_providers()
    for i, p in enumerate(providers):
        if p not in available:
            raise ConfigError(source, f"{key}[{i}]", p,
                              f"execution provider not available in onnxruntime {ort.__version__}; "
                              f"available: {', '.join(available)}")
    if not providers:
        raise ConfigError(source, key, providers, f"at least one provider is needed; available: "
                                                  f"{', '.join(available)}")


@dataclass
class DecoderState:
    """One sequence's KV cache: `past` arrays holding `n_past` positions."""

    past: list[np.ndarray] = field(default_factory=list)
    n_past: int = 0


class OnnxDecoder:
    """A builder-exported decoder in a plain InferenceSession. `vocab_width` pads or cuts the logits to
    the width the caller works in (the target's vocabulary)."""

    def __init__(self, model_dir: Path, providers: list[str] | None = None, threads: int = 1,
                 vocab_width: int | None = None, role: str = "draft"):
        model_dir = Path(model_dir)
        path = model_dir / "model.onnx"
        if not path.is_file():
            raise ModelLoadError(f"{role} model directory {str(model_dir)!r} has no model.onnx")
        providers = providers or ["CPUExecutionProvider"]
        check_providers(providers, key=f"{role}.providers")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ModelLoadError(f"cannot load {role} model {str(path)!r}: {exc}") from exc
        self.model_dir = model_dir
        self._setup_io(model_dir)
        self.vocab_width = vocab_width or self.model_vocab

    def _setup_io(self, model_dir: Path) -> None:
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past_names = sorted((n for n in inputs if n.startswith("past_key_values.")),
                                 key=lambda n: (int(n.split(".")[1]), n.endswith("value")))
        self.present_names = [n.replace("past_key_values.", "present.") for n in self.past_names]
        self.has_position_ids = "position_ids" in inputs
        first = inputs[self.past_names[0]] if self.past_names else None
        gcfg_path = model_dir / "genai_config.json"
        self.genai_config = json.loads(gcfg_path.read_text())["model"] if gcfg_path.is_file() else {}
        gcfg = self.genai_config
        dec = gcfg.get("decoder", {})
        kv_heads = dec.get("num_key_value_heads") or (first.shape[1] if first is not None else 0)
        head_dim = dec.get("head_size") or (first.shape[3] if first is not None else 0)
        if not isinstance(kv_heads, int) or not isinstance(head_dim, int):
            raise ModelLoadError(f"{model_dir}: cannot tell the KV cache shape (no genai_config.json)")
        self.kv_shape = (1, kv_heads, 0, head_dim)
        self.kv_dtype = _ORT_DTYPES.get(first.type, np.float32) if first is not None else np.float32
        logits_out = next(o for o in self.session.get_outputs() if o.name == "logits")
        width = logits_out.shape[-1]
        self.model_vocab = int(width) if isinstance(width, int) else int(gcfg.get("vocab_size", 0))
        self.context_len = int(gcfg.get("context_length") or 1 << 30)

    def new_state(self) -> DecoderState:
        return DecoderState()

    def append(self, state: DecoderState, tokens: list[int]) -> np.ndarray:
        """Run tokens after the state's cached past; returns logits [len(tokens), vocab_width]."""
        n = len(tokens)
        feeds = {
            "input_ids": np.asarray([tokens], dtype=np.int64),
            "attention_mask": np.ones((1, state.n_past + n), dtype=np.int64),
        }
        if self.has_position_ids:
            feeds["position_ids"] = np.arange(state.n_past, state.n_past + n, dtype=np.int64)[None]
        if not state.past:
            state.past = [np.zeros(self.kv_shape, dtype=self.kv_dtype) for _ in self.past_names]
        feeds.update(zip(self.past_names, state.past))
        outs = self.session.run(["logits", *self.present_names], feeds)
        state.past = outs[1:]
        state.n_past += n
        return self.fit_width(outs[0][0])

    def rewind(self, state: DecoderState, n: int) -> None:
        """Keep only the first n cached positions."""
        if n > state.n_past:
            raise ValueError(f"cannot rewind to {n}; cache holds {state.n_past}")
        if n < state.n_past:
            state.past = [p[:, :, :n, :] for p in state.past]
            state.n_past = n

    def fit_width(self, logits: np.ndarray) -> np.ndarray:
        """Make the logits as wide as vocab_width (-inf where the model has no column)."""
        w = self.vocab_width
        if logits.shape[-1] == w:
            return logits
        if logits.shape[-1] > w:
            return logits[..., :w]
        pad = np.full((*logits.shape[:-1], w - logits.shape[-1]), -np.inf, dtype=logits.dtype)
        return np.concatenate([logits, pad], axis=-1)
