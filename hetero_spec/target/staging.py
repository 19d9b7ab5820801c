"""Host -> device staging of candidate token ids for the target's forward pass (only ids: q and p stay in numpy).

On CUDA: one reused pinned host buffer and one device buffer, copied non_blocking on a side stream that the compute
stream waits for (an event); two waits keep the reused buffers safe (see `tokens`), and in the decode loop neither
normally blocks. On a CPU (or a torch build without CUDA, where pin_memory=True raises) it is a plain tensor.
"""

from __future__ import annotations

import torch


class Staging:
    """Reusable staging buffers for the candidate ids of one device."""

    def __init__(self, device: torch.device, max_tokens: int = 128):
        self.device, self.copies = device, 0
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        if self.cuda:
            self.stream = torch.cuda.Stream(device=device)
            self._tok_host = torch.empty(max_tokens, dtype=torch.long, pin_memory=True)
            self._tok_dev = torch.empty(max_tokens, dtype=torch.long, device=device)
            self._copied = torch.cuda.Event()  # the last host -> device copy (unrecorded: no wait)

    def sync(self) -> None:
        """Wait for the work queued so far (CUDA launches return at once): a stage timed on the host, such as the
        prefill, ends here and not inside the next one."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @property
    def pinned(self) -> bool:
        return self.cuda and self._tok_host.is_pinned()

    def tokens(self, ids: list[int]) -> torch.Tensor:
        """ids -> a [1, len] long tensor on the device (async on CUDA; the compute stream waits). On CUDA the
        result is a view of the reused device buffer: valid until the next call."""
        if not self.cuda:
            return torch.tensor([ids], dtype=torch.long)
        count = len(ids)
        compute = torch.cuda.current_stream(self.device)
        self._copied.synchronize()  # the previous copy may still be reading the pinned buffer
        if count > self._tok_host.numel():
            self._tok_host = torch.empty(2 * count, dtype=torch.long, pin_memory=True)
            self._tok_dev = torch.empty(2 * count, dtype=torch.long, device=self.device)
        self._tok_host[:count].copy_(torch.as_tensor(ids, dtype=torch.long))
        self.stream.wait_stream(compute)  # earlier forward passes may still read the device buffer
        with torch.cuda.stream(self.stream):
            self._tok_dev[:count].copy_(self._tok_host[:count], non_blocking=True)
            self._copied.record(self.stream)
        compute.wait_event(self._copied)
        self.copies += 1
        return self._tok_dev[:count].view(1, count)
