"""KV caches stored below the compute precision (`target.kv_cache_dtype`, torch backend): int8 or fp8 (e4m3) with a
float32 scale per token and head (absmax over the head's dimensions: 1 + 4/head_dim bytes per value), or plain
fp16/bf16, dequantized on read. Why output stays identical, and the cost: docs/features-precision.md."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

_QMAX = {"int8": 127.0, "fp8": 448.0}
_STORE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp16": torch.float16, "bf16": torch.bfloat16}


class StoredKVLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are kept as `kind` (int8, fp8, fp16, bf16) and returned dequantized."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.parts: list[torch.Tensor] = []  # keys, key scales, values, value scales (or keys, values)

    def _pack(self, states: torch.Tensor) -> list[torch.Tensor]:
        if self.kind not in _QMAX:
            return [states.to(_STORE[self.kind])]
        scale = states.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-8) / _QMAX[self.kind]
        scaled = states.float() / scale
        scaled = scaled.round().clamp(-127, 127) if self.kind == "int8" else scaled
        return [scaled.to(_STORE[self.kind]), scale]

    def _unpack(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return parts[0].to(dtype) if len(parts) == 1 else (parts[0].float() * parts[1]).to(dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        new = self._pack(key_states) + self._pack(value_states)
        self.parts = [torch.cat([old, x], dim=-2) for old, x in zip(self.parts, new)] if self.parts else new
        half = len(self.parts) // 2  # the keys' parts, then the values'
        return self._unpack(self.parts[:half], self.dtype), self._unpack(self.parts[half:], self.dtype)

    def get_seq_length(self) -> int:
        return self.parts[0].shape[-2] if self.parts else 0

    def crop(self, tokens_to_remove: int) -> None:
        """tokens_to_remove: negative, as TargetModel.rollback calls it."""
        if tokens_to_remove and self.parts:
            self.parts = [p[..., :tokens_to_remove, :] for p in self.parts]

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts)
