"""PyTorch target (target/base.py's interface): prefill once, verify a block of k draft tokens in one forward pass,
roll back. Per-request state (KV cache and its length) lives in `TargetState`. Sliding-window layers record the past
after the prefill, so a crop can undo a rejected block (docs/architecture.md#target-backends); caches whose state a
crop cannot restore (linear-attention, recurrent) are refused."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers import cache_utils
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer, DynamicSlidingWindowLayer
from transformers.utils import logging as hf_logging

from ..errors import ModelLoadError
from .kv_store import StoredKVLayer
from .staging import Staging

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cache_keyword(model_cls: type) -> str:
    """The keyword model_cls.forward takes its KV cache by: `cache` (transformers 5.20 and later) or
    `past_key_values` (earlier 5.x, such as the 5.17 of the GPU machine's image). A forward that takes neither would
    swallow the cache in **kwargs and decode with no cache and no error, so that is refused."""
    params = inspect.signature(model_cls.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{model_cls.__name__}.forward takes neither cache= nor past_key_values=: this transformers "
                    f"version cannot be given a KV cache")


def resolve_device(device: str) -> torch.device:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"target.device is {device!r} but this torch build has no CUDA device "
                             f"(torch {torch.__version__}); use device: cpu or auto")
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)


@dataclass
class TargetState:
    """One request's target-side state: the KV cache and how many tokens it holds."""

    cache: object
    n_cached: int = 0


class TargetModel:
    """A loaded Hugging Face causal LM used as the verifier (implements target.base.Verifier)."""

    backend = "torch"

    def __init__(self, model_dir: Path, device: str = "auto", dtype: str = "auto", threads: int | None = None,
                 max_context: int | None = None, quantize: str | None = None, kv_cache_dtype: str = "auto"):
        hf_logging.disable_progress_bar()
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise ModelLoadError(f"target model directory {str(model_dir)!r} has no config.json")
        if threads:
            torch.set_num_threads(threads)
        self.device = resolve_device(device)
        auto = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = auto if dtype == "auto" else _DTYPES[dtype]
        try:
            config = AutoConfig.from_pretrained(model_dir)
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype).to(self.device)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot load target model from {str(model_dir)!r}: {exc}") from exc
        self.model.eval()
        try:
            self.cache_kw = cache_keyword(type(self.model))
        except TypeError as exc:
            raise ModelLoadError(f"target model {str(model_dir)!r}: {exc}") from exc
        if quantize == "int8":  # target.precision int8 on a CPU: int8 Linear weights, activations per call
            if self.device.type != "cpu":
                raise ModelLoadError("target.precision int8 with the torch backend runs on a CPU only")
            from torch.ao.quantization import quantize_dynamic
            self.model = quantize_dynamic(self.model, {torch.nn.Linear}, dtype=torch.qint8)
        # verified row by row: int8 weights take one activation scale per call (rows sharing a pass would change
        # each other's rounding), and the padded batch reads raw keys, which a stored cache does not keep
        self.quantized = quantize is not None or kv_cache_dtype != "auto"
        self.batch_blocks = not self.quantized  # blocks of different lengths share a pass (padding masks)
        self.config, self.model_dir, self.kv_cache_dtype = config, model_dir, kv_cache_dtype
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError):
            self.tokenizer = None
        head = self.model.get_output_embeddings()
        self.vocab_width = int(head.out_features if hasattr(head, "out_features") else head.weight.shape[0])
        model_ctx = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        self.context_len = int(min((x for x in (model_ctx, max_context) if x), default=2048))
        self.eos_token_ids = _eos_ids(self.model, config)
        self.windowed = _check_rollback(config, model_dir)
        if self.windowed and kv_cache_dtype != "auto":
            raise ModelLoadError(f"target model {str(model_dir)!r} has sliding-window layers; target.kv_cache_dtype "
                                 f"{kv_cache_dtype} supports full-attention caches only (use auto)")
        self.staging = Staging(self.device)

    def new_state(self) -> TargetState:
        cache = DynamicCache(config=self.config)
        if self.kv_cache_dtype != "auto":
            cache.layers = [StoredKVLayer(self.kv_cache_dtype) for _ in cache.layers]
        return TargetState(cache=cache)

    def enable_batching(self, slots: int) -> None:
        """Nothing to set up: verify_batch builds each batch from the rows' own caches."""

    def release_state(self, state: TargetState) -> None:
        """Drop the request's cache now (a request ended or was cancelled)."""
        state.cache, state.n_cached = None, 0

    @torch.inference_mode()
    def forward(self, state: TargetState, tokens: list[int], last_only: bool = False) -> torch.Tensor:
        """Append tokens to the cache; return their logits, [len(tokens), vocab] on the model device
        (only the last position's, [1, vocab], with last_only: the prefill needs none of the others)."""
        if not tokens:
            raise ValueError("forward needs at least one token")
        ids = self.staging.tokens(tokens)  # [1, n]; pinned + async on CUDA
        extra = {"logits_to_keep": 1} if last_only else {}
        out = self.model(input_ids=ids, use_cache=True, **{self.cache_kw: state.cache}, **extra)
        state.n_cached += len(tokens)
        return out.logits[0]

    def rollback(self, state: TargetState, n_keep: int) -> None:
        """Drop cached positions after the first n_keep (the rejected draft tokens)."""
        drop = state.n_cached - n_keep
        if drop < 0:
            raise ValueError(f"cannot roll back to {n_keep} tokens; cache holds {state.n_cached}")
        # crop(0) is not a no-op on a recording sliding-window layer: it trims the states kept for
        # this rollback back to the window, so a fully accepted block must crop too
        if drop or (self.windowed and state.n_cached):
            state.cache.crop(-drop)
            state.n_cached = n_keep

    def prefill(self, state: TargetState, prompt_ids: list[int], start: int = 0, stop: int | None = None) -> None:
        """Cache prompt_ids[start:stop], by default every prompt token but the last (target/base.py's invariant)."""
        stop = len(prompt_ids) - 1 if stop is None else stop
        if stop > start:
            self.forward(state, prompt_ids[start:stop], last_only=True)
            self.staging.sync()  # its time is the prefill's, not the first verify's (nothing reads its logits)
        if stop >= len(prompt_ids) - 1:
            # Only now: the prompt is never rolled back, and recording during the prefill would keep every
            # prompt state in every sliding layer until the first crop.
            state.cache.activate_past_recording()

    def verify(self, state: TargetState, last_token: int, draft_ids: list[int], greedy: bool) -> list[int] | np.ndarray:
        return _outputs(self.forward(state, [last_token, *draft_ids]), greedy)

    @torch.inference_mode()
    def verify_batch(self, rows: list[tuple[TargetState, int, list[int]]], greedy: list[bool]) -> list:
        """Verify several requests' blocks in ONE forward pass: what `verify` returns for each row. Padded: each
        row's past right-aligned in [B, heads, L, dim] (L the longest past; masked zeros on its left), its block
        left-aligned in [B, K] (the pad tokens after it are seen by nothing real, attention being causal), explicit
        positions. Each row then takes back its own new positions, so a rollback never leaves a pad behind.
        Sliding-window caches (a padded copy cannot keep their recorded past) and quantized models (see __init__)
        verify one row per pass."""
        if len(greedy) != len(rows):
            raise ValueError(f"verify_batch: {len(rows)} rows but {len(greedy)} greedy flags")
        if len(rows) == 1 or self.windowed or self.quantized:
            return [self.verify(state, last, draft, g) for (state, last, draft), g in zip(rows, greedy)]
        lens = [state.n_cached for state, _, _ in rows]
        blocks = [[last, *draft] for _, last, draft in rows]
        big_l, big_k = max(lens), max(len(b) for b in blocks)
        batch = self._padded_cache([state.cache for state, _, _ in rows], lens, big_l)
        ids = torch.zeros((len(rows), big_k), dtype=torch.long)
        mask = torch.zeros((len(rows), big_l + big_k), dtype=torch.long)
        for i, (n, block) in enumerate(zip(lens, blocks)):
            ids[i, :len(block)] = torch.tensor(block)
            mask[i, big_l - n:] = 1
        pos = torch.tensor(lens)[:, None] + torch.arange(big_k)[None]
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=pos.to(self.device), use_cache=True, **{self.cache_kw: batch})
        results = []
        for i, ((state, _, _), block) in enumerate(zip(rows, blocks)):
            end = big_l + len(block)
            for layer, new in zip(state.cache.layers, batch.layers):
                layer.update(new.keys[i:i + 1, :, big_l:end], new.values[i:i + 1, :, big_l:end])
            state.n_cached += len(block)
            results.append(_outputs(out.logits[i, :len(block)], greedy[i]))
        return results

    def _padded_cache(self, caches: list, lens: list[int], big_l: int):
        """One DynamicCache [B, heads, big_l, dim] per layer: each row's past right-aligned, zeros before it."""
        batch = DynamicCache(config=self.config)
        if not big_l:
            return batch
        like = next(cache for cache, n in zip(caches, lens) if n).layers  # a row with a past: shapes the empty ones

        def padded(tensors: list[torch.Tensor]) -> torch.Tensor:  # each [1, heads, >= n, dim] -> [B, heads, big_l, dim]
            return torch.cat([F.pad(t[:, :, :n], (0, 0, big_l - n, 0)) for t, n in zip(tensors, lens)])

        for li, layer in enumerate(batch.layers):
            srcs = [cache.layers[li] if n else like[li] for cache, n in zip(caches, lens)]
            layer.update(padded([s.keys for s in srcs]), padded([s.values for s in srcs]))
        return batch


def _outputs(logits: torch.Tensor, greedy: bool) -> list[int] | np.ndarray:
    """A verify pass's result for one row: argmax ids [k + 1] (greedy) or float32 logits [k + 1, vocab]."""
    return logits.argmax(dim=-1).tolist() if greedy else logits.float().cpu().numpy()


def _check_rollback(config, model_dir: Path) -> bool:
    """Refuse a model whose cache `crop` cannot roll back exactly; return whether it has sliding-window layers.
    Full-attention and sliding-window (or chunked) KV layers crop exactly once past recording is on. Linear-attention,
    conv and hybrid layers (Mamba-style or gated-delta-net models) keep a recurrent state that crop does not restore,
    and any other layer type is unknown to this verifier."""
    # DummyLayer (a layer that keeps no cache) is new in transformers 5.2x; 5.17 has none
    exact = (DynamicLayer, DynamicSlidingWindowLayer, DynamicIndexedLayer, *_optional(cache_utils, "DummyLayer"))
    try:
        layers = DynamicCache(config=config).layers
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"target model {str(model_dir)!r}: cannot build its KV cache ({exc})") from exc
    bad = sorted({type(layer).__name__ for layer in layers if type(layer) not in exact})
    if bad:
        raise ModelLoadError(
            f"target model {str(model_dir)!r} (model_type {getattr(config, 'model_type', '?')!r}) is not "
            f"supported as a verifier: its cache has {', '.join(bad)} layers, whose state cannot be rolled "
            "back exactly after rejected draft tokens (only full-attention and sliding-window KV caches can)")
    return any(getattr(layer, "is_sliding", False) for layer in layers)


def _eos_ids(model, config) -> set[int]:
    found = [getattr(src, "eos_token_id", None) for src in (getattr(model, "generation_config", None), config)]
    return {int(e) for eos in found for e in ([eos] if isinstance(eos, int) else eos or ())}


def _optional(module, *names: str) -> tuple:
    """Those of module's attributes that this version of it has."""
    return tuple(getattr(module, name) for name in names if hasattr(module, name))
