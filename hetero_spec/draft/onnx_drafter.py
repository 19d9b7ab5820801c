"""Draft model under a plain ONNX Runtime InferenceSession, with its own KV cache in numpy.

The model is the decoder exported by onnxruntime-genai's builder (`hetero-spec export`):
inputs `input_ids`, `attention_mask` (total length), optionally `position_ids`, and
`past_key_values.N.key/value` [batch, kv_heads, past, head_dim]; outputs `logits` and `present.N.*`.
Rolling back is slicing the past along its third axis.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..errors import ConfigError, ModelLoadError
from ..sampling import (STREAM_DRAFT, SamplingParams, coupled_choice, exponential_noise, logits_to_probs,
                        position_uniforms, sample_from)
from .base import Draft

log = logging.getLogger(__name__)

_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def _alternatives(logits: np.ndarray, top: int) -> tuple[float, tuple[int, int]]:
    """The draft's top-1 probability and its 2nd and 3rd choices, for branch pre-drafting."""
    rest = logits.copy()  # three argmax passes beat argpartition on a vocabulary row
    rest[top] = -np.inf
    second = int(np.argmax(rest))
    rest[second] = -np.inf
    third = int(np.argmax(rest))
    z = float(np.exp(logits - logits[top]).sum())
    return 1.0 / z, (second, third)


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


class OnnxDrafter:
    """Proposer backed by an exported ONNX decoder. Holds the state of one request at a time."""

    name = "onnx"

    def __init__(self, model_dir: Path, providers: list[str] | None = None, threads: int = 1,
                 vocab_width: int | None = None):
        model_dir = Path(model_dir)
        path = model_dir / "model.onnx"
        if not path.is_file():
            raise ModelLoadError(f"draft model directory {str(model_dir)!r} has no model.onnx")
        providers = providers or ["CPUExecutionProvider"]
        check_providers(providers)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ModelLoadError(f"cannot load draft model {str(path)!r}: {exc}") from exc
        self.model_dir = model_dir
        self._setup_io(model_dir)
        self.vocab_width = vocab_width or self.model_vocab
        self.params = SamplingParams()
        self.ids: list[int] = []
        self.past: list[np.ndarray] = []
        self.n_past = 0
        self._proposed: list[int] = []
        self.last_catchup_s = 0.0
        # position -> (top-1 probability, (2nd, 3rd choice)) of the draft there (greedy only)
        self.alts: dict[int, tuple[float, tuple[int, int]]] = {}

    def _setup_io(self, model_dir: Path) -> None:
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past_names = sorted((n for n in inputs if n.startswith("past_key_values.")),
                                 key=lambda n: (int(n.split(".")[1]), n.endswith("value")))
        self.present_names = [n.replace("past_key_values.", "present.") for n in self.past_names]
        self.has_position_ids = "position_ids" in inputs
        first = inputs[self.past_names[0]] if self.past_names else None
        gcfg_path = model_dir / "genai_config.json"
        gcfg = json.loads(gcfg_path.read_text())["model"] if gcfg_path.is_file() else {}
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

    # -- low level: append tokens / rewind, as onnxruntime-genai's Generator does ------------------
    def append(self, tokens: list[int]) -> np.ndarray:
        """Run tokens through the model after the cached past; returns logits [len(tokens), vocab_width]."""
        n = len(tokens)
        feeds = {
            "input_ids": np.asarray([tokens], dtype=np.int64),
            "attention_mask": np.ones((1, self.n_past + n), dtype=np.int64),
        }
        if self.has_position_ids:
            feeds["position_ids"] = np.arange(self.n_past, self.n_past + n, dtype=np.int64)[None]
        if not self.past:
            self.past = [np.zeros(self.kv_shape, dtype=self.kv_dtype) for _ in self.past_names]
        feeds.update(zip(self.past_names, self.past))
        outs = self.session.run(["logits", *self.present_names], feeds)
        self.past = outs[1:]
        self.n_past += n
        return self._fit_width(outs[0][0])

    def rewind_to(self, n: int) -> None:
        """Keep only the first n cached positions."""
        if n > self.n_past:
            raise ValueError(f"cannot rewind to {n}; cache holds {self.n_past}")
        if n < self.n_past:
            self.past = [p[:, :, :n, :] for p in self.past]
            self.n_past = n

    def _fit_width(self, logits: np.ndarray) -> np.ndarray:
        """Make the logits as wide as the target's vocabulary (-inf where the draft has no column)."""
        w = self.vocab_width
        if logits.shape[-1] == w:
            return logits
        if logits.shape[-1] > w:
            return logits[..., :w]
        pad = np.full((*logits.shape[:-1], w - logits.shape[-1]), -np.inf, dtype=logits.dtype)
        return np.concatenate([logits, pad], axis=-1)

    # -- Proposer protocol -------------------------------------------------------------------------
    def begin(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.ids = list(prompt_ids)
        self.params = params
        self.past, self.n_past, self._proposed = [], 0, []
        self.alts = {}

    def _choose(self, logits_row: np.ndarray, position: int) -> tuple[int, np.ndarray | None]:
        """Pick the token at an absolute position: argmax; coupled: argmax(log q + g) with the noise the
        target uses there (q stays home: None); rejection: a draw from q keyed by (seed, position)."""
        if self.params.greedy:
            return int(np.argmax(logits_row)), None
        q = logits_to_probs(logits_row[None], self.params)[0]
        if self.params.coupled:
            return coupled_choice(q, exponential_noise(self.params.seed, position, q.shape[0])), None
        return sample_from(q, position_uniforms(self.params.seed, position, STREAM_DRAFT)[0]), q

    def propose(self, k: int) -> Draft:
        k = min(k, self.context_len - len(self.ids))
        if k <= 0:
            self._proposed = []
            return Draft(ids=[])
        pending = self.ids[self.n_past:]
        if not pending:  # everything is cached: re-feed the last token to get its logits
            self.rewind_to(self.n_past - 1)
            pending = self.ids[-1:]
        out: list[int] = []
        probs: list[np.ndarray] = []
        for i in range(k):
            tok, q = self._choose(self.append(pending)[-1], len(self.ids) + i)
            out.append(tok)
            if q is not None:
                probs.append(q)
            pending = [tok]
        self._proposed = out
        return Draft(ids=out, probs=np.stack(probs) if probs else None)

    # -- stream mode (the pipelined worker): draft ahead, assuming acceptance; truncate on correction --
    def extend(self, n: int, stop=None) -> Draft:
        """Append n of the draft's own tokens to `ids` (feeding each one), as if all were accepted.
        `stop()` (optional) is asked before every token after the first; True ends the run early."""
        n = min(n, self.context_len - len(self.ids))
        out: list[int] = []
        probs: list[np.ndarray] = []
        self.last_catchup_s = 0.0
        for i in range(max(n, 0)):
            if i and stop is not None and stop():
                break
            pending = self.ids[self.n_past:]
            if not pending:
                self.rewind_to(self.n_past - 1)
                pending = self.ids[-1:]
            t0 = time.perf_counter() if len(pending) > 2 else 0.0
            logits = self.append(pending)[-1]
            if t0:  # feeding a prompt or a backlog of committed tokens: not a per-token drafting cost
                self.last_catchup_s = time.perf_counter() - t0
            tok, q = self._choose(logits, len(self.ids))
            if self.params.greedy and logits.shape[-1] > 3:  # for branch pre-drafting
                self.alts[len(self.ids)] = _alternatives(logits, tok)
            self.ids.append(tok)
            out.append(tok)
            if q is not None:
                probs.append(q)
        return Draft(ids=out, probs=np.stack(probs) if probs else None)

    def truncate(self, length: int) -> None:
        """Forget tokens from position `length` on (and their cache entries)."""
        del self.ids[length:]
        self.rewind_to(min(self.n_past, length))

    def branch(self, position: int, token: int, n: int, stop=None) -> tuple[list[int], list[np.ndarray], int]:
        """Draft n tokens after ids[:position] + [token] without disturbing the current stream.
        Returns (tokens, past, n_past, alts) for `adopt`. The past arrays are never mutated in place, so
        slicing them here is free and the stream's own cache stays valid."""
        saved = (list(self.ids), self.past, self.n_past, self.alts)
        self.truncate(position)
        self.ids.append(token)
        self.alts = {}
        tokens = self.extend(n, stop=stop).ids
        result = (tokens, self.past, self.n_past, self.alts)
        self.ids[:], self.past, self.n_past, self.alts = saved
        return result

    def adopt(self, position: int, token: int, branch: tuple) -> None:
        """Replace the stream from `position` on by a pre-drafted branch that starts with `token`."""
        tokens, past, n_past, alts = branch
        self.ids[position:] = [token, *tokens]
        self.past, self.n_past = past, n_past
        self.alts = {p: a for p, a in self.alts.items() if p < position}
        self.alts.update(alts)

    def commit(self, n_accepted: int, next_token: int) -> None:
        base = len(self.ids)
        self.ids.extend([*self._proposed[:n_accepted], next_token])
        self.rewind_to(min(self.n_past, base + n_accepted))
        self._proposed = []

    def close(self) -> None:
        self.past = []
