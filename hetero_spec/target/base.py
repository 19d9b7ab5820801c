"""The target-side interface: what the decode loop (scheduler.py) needs of a verifier (verifier.TargetModel: torch;
onnx_backend.OnnxTarget: ONNX Runtime). Each request's state (KV cache and its length, `n_cached`) lives in the object
`new_state()` returns, never in the model, so one loaded model serves many requests and one pass can verify several
states' blocks (`verify_batch`).

Cache invariant: the state caches every committed token but the last, which is fed at the start of the next pass
together with the draft block: verify `[last, d1..dk]`, then roll back to what was accepted.

A verifier whose `supports_tree` is true also has `verify_tree(state, last_token, draft_ids, alts, greedy)` (the
chain and second choices beside it in one pass: onnx_backend.OnnxTarget.verify_tree) and `move(state, src, dst)`
(a kept node's cached position into place); the loop asks for neither where it is false or missing.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Verifier(Protocol):
    backend: str  # "torch" | "onnx"
    vocab_width: int  # width of the logits the loop works in
    context_len: int  # prompt + generated tokens may not exceed it
    eos_token_ids: set[int]
    tokenizer: Any  # encode(text) / decode(ids, skip_special_tokens=...), or None
    batch_blocks: bool  # rows with draft blocks of different lengths share a verify_batch pass (else 1-token rows)

    def new_state(self) -> Any:
        """A fresh per-request state (empty cache, n_cached == 0)."""

    def prefill(self, state: Any, prompt_ids: list[int], start: int = 0, stop: int | None = None) -> None:
        """Cache prompt_ids[start:stop]; stop defaults to every prompt token but the last, and the call that reaches
        it finishes the prefill. A chunked prefill (serving.prefill_chunk) makes these calls in order."""

    def verify(self, state: Any, last_token: int, draft_ids: list[int], greedy: bool) -> Any:
        """One pass over [last_token, *draft_ids]: argmax ids [k + 1] (greedy) or float32 logits [k + 1, vocab]."""

    def greedy_steps(self, state: Any, last_token: int, n: int) -> list[int]:
        """n greedy one-token passes, each fed the argmax of the one before, starting with last_token: the n argmax
        ids, all but the last now cached (what n rounds of verify without a draft give, in one call)."""

    def rollback(self, state: Any, n_keep: int) -> None:
        """Keep the first n_keep cached positions (drop the rejected drafts)."""

    def enable_batching(self, slots: int) -> None:
        """Prepare for up to `slots` states verified together (the request scheduler's serving.max_batch)."""

    def verify_batch(self, rows: list[tuple[Any, int, list[int]]], greedy: list[bool]) -> list[Any]:
        """Rows (state, last_token, draft_ids), a greedy flag per row: what `verify` returns for each, in as few
        passes as it can."""

    def release_state(self, state: Any) -> None:
        """The request is over: free its cache (a batched buffer's slot) now."""
