"""Host -> device staging of candidate tokens (and draft probabilities when sampling).

On CUDA: one reusable pinned (page-locked) host buffer per kind; candidates are written into it and
copied with non_blocking=True on a side stream, and the compute stream waits on an event only when it
needs the data, so the copy overlaps whatever the GPU is doing. On CPU (or a torch build without CUDA,
where pin_memory=True raises) it degrades to a plain tensor: there is nothing to copy.
"""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    """Reusable staging buffers for one device."""

    def __init__(self, device: torch.device, max_tokens: int = 128, vocab: int = 0):
        self.device = device
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.copies = 0
        if self.cuda:
            self.stream = torch.cuda.Stream(device=device)
            self._tok_host = torch.empty(max_tokens, dtype=torch.long, pin_memory=True)
            self._tok_dev = torch.empty(max_tokens, dtype=torch.long, device=device)
            self._prob_host = torch.empty((0, vocab), dtype=torch.float32, pin_memory=True) if vocab else None
            self._prob_dev = None
            self._ready = torch.cuda.Event()

    @property
    def pinned(self) -> bool:
        return self.cuda and self._tok_host.is_pinned()

    def tokens(self, ids: list[int]) -> torch.Tensor:
        """ids -> a [1, len] long tensor on the device (async on CUDA; the compute stream waits)."""
        n = len(ids)
        if not self.cuda:
            return torch.tensor([ids], dtype=torch.long)
        if n > self._tok_host.numel():
            self._tok_host = torch.empty(2 * n, dtype=torch.long, pin_memory=True)
            self._tok_dev = torch.empty(2 * n, dtype=torch.long, device=self.device)
        self._tok_host[:n].copy_(torch.as_tensor(ids, dtype=torch.long))
        with torch.cuda.stream(self.stream):
            self._tok_dev[:n].copy_(self._tok_host[:n], non_blocking=True)
            self._ready.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(self._ready)
        self.copies += 1
        return self._tok_dev[:n].view(1, n)

    def probs(self, q: np.ndarray) -> torch.Tensor:
        """q [k, vocab] float32 -> device tensor through the pinned buffer (sampling only)."""
        if not self.cuda:
            return torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32))
        k, v = q.shape
        if self._prob_host is None or self._prob_host.shape[0] < k or self._prob_host.shape[1] != v:
            self._prob_host = torch.empty((max(k, 8), v), dtype=torch.float32, pin_memory=True)
            self._prob_dev = torch.empty((max(k, 8), v), dtype=torch.float32, device=self.device)
        self._prob_host[:k].copy_(torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32)))
        with torch.cuda.stream(self.stream):
            self._prob_dev[:k].copy_(self._prob_host[:k], non_blocking=True)
            self._ready.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(self._ready)
        self.copies += 1
        return self._prob_dev[:k]
