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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, cache_utils
from transformers.cache_utils import Cache, DynamicIndexedLayer, DynamicLayer, DynamicSlidingWindowLayer
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
    """One request's target-side state: the KV cache and how many tokens it holds (slot: its rows in a KeptKV)."""

    cache: object
    n_cached: int = 0
    slot: int | None = None


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
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype).to(self.device).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot load target model from {str(model_dir)!r}: {exc}") from exc
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
        self.kept: KeptKV | None = None

    def new_state(self) -> TargetState:
        if self.kept is not None and (slot := self.kept.acquire()) is not None:
            state = TargetState(cache=None, slot=slot)
            state.cache = self.kept.cache([state])
            return state
        cache = DynamicCache(config=self.config)
        if self.kv_cache_dtype != "auto":
            cache.layers = [StoredKVLayer(self.kv_cache_dtype) for _ in cache.layers]
        return TargetState(cache=cache)

    def enable_batching(self, slots: int) -> None:
        """States from now on are slots of one kept batch cache (up to `slots`; more get caches of their own), which
        verify_batch reads in place. Sliding-window and quantized models keep a cache per row (verified row by row)."""
        if slots > 1 and self.kept is None and not (self.windowed or self.quantized):
            self.kept = KeptKV(len(DynamicCache(config=self.config).layers), slots)

    def release_state(self, state: TargetState) -> None:
        """Drop the request's cache now (a request ended or was cancelled); its slot is free for the next."""
        if state.slot is not None and self.kept is not None:
            self.kept.release(state.slot)
        state.cache, state.n_cached, state.slot = None, 0, None

    @torch.inference_mode()
    def forward(self, state: TargetState, tokens: list[int], last_only: bool = False) -> torch.Tensor:
        """Append tokens to the cache; return their logits, [len(tokens), vocab] on the model device
        (only the last position's, [1, vocab], with last_only: the prefill needs none of the others)."""
        ids = self.staging.tokens(tokens)  # [1, n]; pinned + async on CUDA
        # logits_to_keep: 1, the last position's; 0, every position's
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=int(last_only), **{self.cache_kw: state.cache})
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

    def greedy_steps(self, state: TargetState, last_token: int, n: int) -> list[int]:
        out = []
        for _ in range(n):
            last_token = self.verify(state, last_token, [], True)[0]
            out.append(last_token)
        return out

    @torch.inference_mode()
    def verify_batch(self, rows: list[tuple[TargetState, int, list[int]]], greedy: list[bool]) -> list:
        """Verify several requests' blocks in ONE forward pass: what `verify` returns for each row. The rows' caches
        are their slots of the kept cache, read in place (KeptKV); each block is left-aligned in [B, K] and written
        after its own past, and a 4D mask lets query j of a row see its past and its block up to j (the pad after
        a short block is seen by nothing real). Rows without a slot verify one per pass."""
        if len(rows) == 1 or any(state.slot is None for state, _, _ in rows):
            return [self.verify(state, last, draft, g) for (state, last, draft), g in zip(rows, greedy)]
        order = sorted(range(len(rows)), key=lambda i: rows[i][0].slot)  # ascending slots: a view when contiguous
        states = [rows[i][0] for i in order]
        blocks = [[rows[i][1], *rows[i][2]] for i in order]
        big_k = max(len(block) for block in blocks)
        ids = torch.tensor([block + [0] * (big_k - len(block)) for block in blocks])  # [B, K]
        past = torch.tensor([state.n_cached for state in states])
        pos = past[:, None] + torch.arange(big_k)[None]  # [B, K]
        seen = torch.arange(int(past.max()) + big_k)[None, None] <= pos[:, :, None]  # [B, K, L]
        mask = torch.zeros(seen.shape, dtype=self.dtype).masked_fill(~seen, torch.finfo(self.dtype).min)
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask[:, None].to(self.device),
                         position_ids=pos.to(self.device), use_cache=True, **{self.cache_kw: self.kept.cache(states)})
        results: list = [None] * len(rows)
        for i, (state, block) in enumerate(zip(states, blocks)):
            state.n_cached += len(block)
            results[order[i]] = _outputs(out.logits[i, :len(block)], greedy[order[i]])
        return results


class KeptKV:
    """The kept KV cache of a batch's rows (enable_batching): per layer, keys and values [slots, kv_heads, capacity,
    head_dim], allocated at the first write and grown (doubled, once for all slots) when a row needs more. A state
    owns a slot; its past is positions [0, n_cached) of it, so a rollback is its count alone. A pass over rows in
    adjacent slots reads a view of the buffer, with no copy (vLLM's and the onnx KvPool's idea)."""

    def __init__(self, n_layers: int, slots: int):
        self.slots, self.keys, self.values = slots, [None] * n_layers, [None] * n_layers
        self._free = list(range(slots))

    def acquire(self) -> int | None:
        return self._free.pop(0) if self._free else None

    def release(self, slot: int) -> None:
        self._free = sorted({*self._free, slot})

    def cache(self, states: list[TargetState]) -> Cache:
        """A transformers Cache over these states' slots (in this order; one state: that request's own cache)."""
        return Cache(layers=[SlotLayer(self, layer, states) for layer in range(len(self.keys))])

    def write(self, layer: int, states: list[TargetState], keys: torch.Tensor, values: torch.Tensor):
        """Store each row's new keys and values [B, heads, new, dim] after its past; every row's past and new
        positions up to the longest, [B, heads, L, dim] (positions past a row's own are masked)."""
        end = max(state.n_cached for state in states) + keys.shape[2]
        slots = [state.slot for state in states]
        adjacent = slots == list(range(slots[0], slots[0] + len(slots)))
        index = None if adjacent else torch.tensor(slots, device=keys.device)
        out = []
        for buffers, new in ((self.keys, keys), (self.values, values)):
            buf = buffers[layer]
            if buf is None or buf.shape[2] < end:  # doubled, for every slot at once
                size = max(end, 64, 2 * (0 if buf is None else buf.shape[2]))
                grown = new.new_zeros((self.slots, new.shape[1], size, new.shape[3]))
                if buf is not None:
                    grown[:, :, :buf.shape[2]] = buf
                buf = buffers[layer] = grown
            for i, state in enumerate(states):
                buf[state.slot, :, state.n_cached:state.n_cached + new.shape[2]] = new[i]
            out.append(buf[slots[0]:slots[0] + len(slots), :, :end] if adjacent else
                       buf[:, :, :end].index_select(0, index))
        return tuple(out)


class SlotLayer(DynamicLayer):
    """One layer of a Cache over slots of a KeptKV: writes go to the rows' slots; a crop is the state's count."""

    def __init__(self, kept: KeptKV, layer: int, states: list[TargetState]):
        super().__init__()
        self.kept, self.layer, self.states, self.is_initialized = kept, layer, states, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.kept.write(self.layer, self.states, key_states, value_states)

    def get_seq_length(self) -> int:
        return max(state.n_cached for state in self.states)

    def crop(self, tokens_to_remove: int) -> None:
        """Nothing to free: TargetModel.rollback sets the state's count."""


def _outputs(logits: torch.Tensor, greedy: bool) -> list[int] | np.ndarray:
    """A verify pass's result for one row: argmax ids [k + 1] (greedy) or float32 logits [k + 1, vocab]."""
    return logits.argmax(dim=-1).tolist() if greedy else logits.float().cpu().numpy()


def _check_rollback(config, model_dir: Path) -> bool:
    """Refuse a model whose cache `crop` cannot roll back exactly; return whether it has sliding-window layers.
    Full-attention and sliding-window (or chunked) KV layers crop exactly once past recording is on. Linear-attention,
    conv and hybrid layers (Mamba-style or gated-delta-net models) keep a recurrent state that crop does not restore,
    and any other layer type is unknown to this verifier."""
    # DummyLayer (a layer that keeps no cache) is new in transformers 5.2x; 5.17 has none (DynamicLayer stands in)
    exact = (DynamicLayer, DynamicSlidingWindowLayer, DynamicIndexedLayer,
             getattr(cache_utils, "DummyLayer", DynamicLayer))
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

