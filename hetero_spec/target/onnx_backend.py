"""ONNX Runtime target backend: the verifier interface (target/base.py) run by the shared `OnnxDecoder` on a
builder-exported target (`hetero-spec export --model HF_DIR`); about 3x eager PyTorch on a CPU. Never imports torch."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..onnx_decoder import DecoderState, OnnxDecoder

log = logging.getLogger(__name__)


class OnnxTokenizer:
    """The two calls the engine makes of a tokenizer, over `tokenizers` (no transformers, no torch)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer
        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class OnnxTarget:
    """A builder-exported decoder used as the verifier (CPU or an NPU/DirectML execution provider). A request's
    state is the decoder's `DecoderState` (its KV cache)."""

    backend = "onnx"
    #: only rows of one token (no draft) share a pass: the exported GroupQueryAttention refuses a batch of
    #: several-token blocks over different pasts (OnnxDecoder.append_batch); such rows verify one per pass
    batch_blocks = False

    def __init__(self, model_dir: Path, providers: list[str] | None = None, threads: int | None = None,
                 max_context: int | None = None, spin: bool | str = True, prefill_threads: int | None = None,
                 block_dir: Path | None = None, kernels: str = "onnxruntime"):
        self.decoder = OnnxDecoder(model_dir, providers=providers, threads=threads or 1, role="target", spin=spin,
                                   prefill_threads=prefill_threads, block_dir=block_dir, kernels=kernels)
        #: block_dir (target.block_graph): {k: (seconds of a k-token pass on the target's graph, on the block graph)},
        #: measured now; blocks of decoder.block_from tokens or more run on the block graph
        self.block_costs = self.decoder.choose_block_from() if block_dir is not None else {}
        if block_dir is not None:
            log.info("target.block_graph: passes of %s tokens or more on the block graph (%s)",
                     self.decoder.block_from, ", ".join(f"{k}: {a * 1e3:.1f} / {b * 1e3:.1f} ms"
                                                        for k, (a, b) in self.block_costs.items()))
        self.model_dir, self.vocab_width = self.decoder.model_dir, self.decoder.vocab_width
        self.context_len = min(self.decoder.context_len, max_context or self.decoder.context_len)
        eos = self.decoder.genai_config.get("eos_token_id")
        self.eos_token_ids = {int(e) for e in (eos if isinstance(eos, list) else [eos])} if eos is not None else set()
        tok = self.model_dir / "tokenizer.json"
        self.tokenizer = OnnxTokenizer(tok) if tok.is_file() else None
        self._pool = None

    def enable_batching(self, slots: int) -> None:
        """States from now on are slots of one batched KV buffer (up to `slots`; more get their own buffers),
        so that their one-token steps share a pass (verify_batch). Needs the shared-buffer layout."""
        if self.decoder.shared and slots > 1 and self._pool is None:
            self._pool = self.decoder.new_pool(slots)

    def new_state(self) -> DecoderState:
        return (self._pool and self._pool.acquire()) or self.decoder.new_state()

    def release_state(self, state: DecoderState) -> None:
        """Free the state's buffers (its pool slot) now (a request ended); a no-op in the copy layout."""
        if state.pool is not None:
            state.pool.release(state)

    def forward(self, state: DecoderState, tokens: list[int], last_only: bool = False,
                wide: bool = False, scratch: bool = False) -> np.ndarray:
        """Append tokens to the cache; their logits [len(tokens), vocab] (the last row only with last_only).
        wide: on the prefill session's threads (target.prefill_threads), when there is one; scratch: read before the
        state's next run (OnnxDecoder.append)."""
        return self.decoder.append(state, tokens, wide=wide, last_only=last_only, scratch=scratch)

    def rollback(self, state: DecoderState, n_keep: int) -> None:
        """Drop cached positions after the first n_keep (the rejected draft tokens); ValueError past the cache."""
        self.decoder.rewind(state, n_keep)

    def prefill(self, state: DecoderState, prompt_ids: list[int], start: int = 0, stop: int | None = None) -> None:
        """Cache prompt_ids[start:stop], by default every prompt token but the last (target/base.py), on the
        prefill session's threads."""
        stop = len(prompt_ids) - 1 if stop is None else stop
        if stop > start:
            self.forward(state, prompt_ids[start:stop], last_only=True, wide=True)

    def verify(self, state: DecoderState, last_token: int, draft_ids: list[int], greedy: bool) -> list | np.ndarray:
        # greedy: the argmax is taken at once, so a step's logits are read where the run wrote them
        return _outputs(self.forward(state, [last_token, *draft_ids], scratch=greedy), greedy)

    @property
    def supports_tree(self) -> bool:
        """Whether verify_tree can run: the graph takes position_ids and attention_bias (export.add_tree_inputs).
        A tree's pass runs on the target's own graph, never on a block graph."""
        return self.decoder.has_tree

    def verify_tree(self, state: DecoderState, last_token: int, draft_ids: list[int], alts: list[tuple[int, int]],
                    greedy: bool) -> list | np.ndarray:
        """verify() of a chain with second choices, one pass: the nodes [last_token, *draft_ids, *alt tokens],
        alt (j, token) a sibling of draft_ids[j] (its parent is node j). The result covers every node, in that
        order; the cache holds node i at n_cached + i until the caller keeps a path (move, rollback)."""
        k = len(draft_ids)
        parents = [-1, *range(k), *(j for j, _ in alts)]
        logits = self.decoder.append_tree(state, [last_token, *draft_ids, *(t for _, t in alts)], parents)
        return _outputs(logits, greedy)

    def move(self, state: DecoderState, src: int, dst: int) -> None:
        """Copy cached position src to dst (a token tree's kept node into the place its path gives it)."""
        self.decoder.move(state, src, dst)

    def greedy_steps(self, state: DecoderState, last_token: int, n: int) -> list[int]:
        return self.decoder.greedy_steps(state, last_token, n)

    def verify_batch(self, rows: list[tuple[DecoderState, int, list[int]]], greedy: list[bool]) -> list:
        """What `verify` returns for each row (state, last_token, draft_ids; a greedy flag per row). Rows without a
        draft whose states share the pool run as ONE pass; rows with a draft block one per pass (batch_blocks)."""
        results: list = [None] * len(rows)
        singles = [i for i, (state, _, draft) in enumerate(rows)
                   if not draft and self._pool is not None and state.pool is self._pool]
        if len(singles) > 1:
            logits = self.decoder.append_batch([rows[i][0] for i in singles], [rows[i][1] for i in singles])
            for j, i in enumerate(singles):
                results[i] = _outputs(logits[j:j + 1], greedy[i])
        return [self.verify(state, last, draft, g) if r is None else r
                for r, (state, last, draft), g in zip(results, rows, greedy)]


def _outputs(logits: np.ndarray, greedy: bool) -> list[int] | np.ndarray:
    """A verify pass's result for one row: argmax ids [k + 1] (greedy) or float32 logits [k + 1, vocab]."""
    return logits.argmax(axis=-1).tolist() if greedy else logits.astype(np.float32, copy=False)
