"""Draft model: a builder-exported decoder (`hetero-spec export`) run by the shared `OnnxDecoder`, with the stream
logic on top: propose/commit in process, extend/truncate for the pipelined worker. Never imports torch."""

from __future__ import annotations

import bisect
import time
from pathlib import Path

import numpy as np

from ..onnx_decoder import OnnxDecoder
from ..sampling import (STREAM_DRAFT, SamplingParams, coupled_choice, coupled_weights, exponential_noise,
                        logits_to_probs, position_uniforms, sample_from)
from .base import Draft


class OnnxDrafter:
    """Proposer backed by an exported ONNX decoder. Holds the state of one request at a time."""

    name = "onnx"

    def __init__(self, model_dir: Path, providers: list[str] | None = None, threads: int = 1,
                 vocab_width: int | None = None, spin: bool | str = True, prompt_window: int | None = None,
                 catchup_skip: int | None = None, kernels: str = "onnxruntime", second_choices: int = 0):
        if prompt_window is not None and prompt_window < 1:
            raise ValueError(f"prompt_window must be >= 1 (got {prompt_window})")
        self._attach(OnnxDecoder(model_dir, providers=providers, threads=threads, vocab_width=vocab_width,
                                 spin=spin, kernels=kernels), None, prompt_window, catchup_skip)
        #: draft.second_choices: the first N tokens of a draft (propose, greedy or coupled) carry the second choice
        self.second_choices = second_choices

    def spawn(self) -> OnnxDrafter:
        """A drafter for another request on the same loaded model (one session, a state per request; a slot of
        the batched buffer once enable_batching was called, so that `propose_batch` can step it with others)."""
        new = OnnxDrafter.__new__(OnnxDrafter)
        new._attach(self.decoder, self._pool, self.prompt_window, self.catchup_skip)
        new.second_choices = self.second_choices
        return new

    def enable_batching(self, slots: int) -> None:
        """Drafters spawned from now on keep their cache in slots of one batched buffer (shared layout only)."""
        if self.decoder.shared and slots > 1 and self._pool is None:
            self._pool = self.decoder.new_pool(slots)

    @staticmethod
    def propose_batch(drafters: list[OnnxDrafter], lengths: list[int]) -> list[Draft]:
        """Draft lengths[i] tokens for each drafter, stepping them together: what each `propose(k)` would return.
        A backlog of committed tokens is fed alone; then every drafter still drafting takes one step in ONE run
        (`OnnxDecoder.append_batch`: rows equal to one run each, bit for bit). Not slots of one pool: one by one."""
        pool = drafters[0]._pool
        if pool is None or len(drafters) < 2 or any(d.state.pool is not pool for d in drafters):
            return [d.propose(k) for d, k in zip(drafters, lengths)]
        lengths = [min(k, d.context_len - len(d.ids)) for d, k in zip(drafters, lengths)]
        pending = [-1] * len(drafters)  # each drafter's next token to feed
        for j, (drafter, k) in enumerate(zip(drafters, lengths)):
            drafter.last_catchup_s, drafter._proposed = 0.0, []
            if k > 0:
                start, todo = drafter._backlog()
                if len(todo) > 1:
                    started = time.perf_counter()
                    drafter._feed(start, todo[:-1], last_only=True)
                    drafter.last_catchup_s = time.perf_counter() - started
                pending[j] = todo[-1]
        probs: list[list[np.ndarray]] = [[] for _ in drafters]
        for i in range(max(lengths, default=0)):
            live = [j for j, k in enumerate(lengths) if i < k]
            logits = pool.decoder.append_batch([drafters[j].state for j in live], [pending[j] for j in live])
            for row, j in enumerate(live):
                drafter = drafters[j]
                drafter._at.append(len(drafter.ids) + i - 1)  # the token just fed: ids[-1], then this block's drafts
                tok, q = drafter._choose(logits[row], len(drafter.ids) + i)
                drafter._proposed.append(tok)
                if q is not None:
                    probs[j].append(q)
                pending[j] = tok
        return [Draft(ids=list(d._proposed), probs=np.stack(p) if p else None) for d, p in zip(drafters, probs)]

    def _attach(self, decoder: OnnxDecoder, pool, prompt_window: int | None, catchup_skip: int | None) -> None:
        self.decoder, self._pool, self.state = decoder, pool, decoder.new_state()
        self.model_dir, self.vocab_width = decoder.model_dir, decoder.vocab_width
        self.model_vocab, self.context_len = decoder.model_vocab, decoder.context_len
        self.params, self.ids, self._proposed, self.last_catchup_s = SamplingParams(), [], [], 0.0
        # cached position p holds ids[_at[p]] (increasing): ids[0:n_past] unless a catch-up window dropped the far
        # past (the cache then starts at `offset`) or a catch-up skip left a gap; _base: where an empty cache starts
        self._at, self._base = [], 0
        # Both limits trade a little acceptance for speed (proposals never change the output): RoPE attention sees
        # relative positions, so a cache with a gap, or restarted late, is the same model on less context.
        #: draft selection next to a lookup (draft.catchup_skip): only the last catchup_skip of the tokens another
        #: strategy committed are fed
        self.catchup_skip = catchup_skip
        #: one-shot (a re-probe, or draft.prompt_window): a longer backlog restarts the cache on its last tokens
        self.catchup_window: int | None = None
        self.prompt_window = prompt_window  #: draft.prompt_window: each stream's first catchup_window (begin)

    @property
    def n_past(self) -> int:
        """Positions of the current stream held in the draft's KV cache."""
        return self.state.n_past

    @property
    def offset(self) -> int:
        """The index in ids of the first cached token (0 unless a catch-up window dropped the far past)."""
        return self._at[0] if self._at else self._base

    def _fed(self) -> int:
        """The index in ids after the last cached token."""
        return self._at[-1] + 1 if self._at else self._base

    def _feed(self, start: int, tokens: list[int], last_only: bool = False, scratch: bool = False) -> np.ndarray:
        """Run tokens that are ids[start:start + len(tokens)] (drafts: the positions they will take); scratch:
        the logits are read before the next feed (OnnxDecoder.append)."""
        logits = self.decoder.append(self.state, tokens, last_only=last_only, scratch=scratch)
        self._at.extend(range(start, start + len(tokens)))
        return logits

    def _keep_below(self, limit: int) -> None:
        """Drop the cached positions of ids[limit:]."""
        n_keep = bisect.bisect_left(self._at, limit)
        if n_keep < len(self._at):
            self.rewind_to(n_keep)

    def _restart(self, base: int) -> None:
        """An empty cache that starts at ids[base] (in a slot of the pool, when there is one free)."""
        if self.state.pool is not None:
            self.state.pool.release(self.state)
        self.state = (self._pool and self._pool.acquire()) or self.decoder.new_state()
        self._at, self._base = [], base

    # -- low level: append tokens / rewind, as onnxruntime-genai's Generator does ------------------
    def append(self, tokens: list[int]) -> np.ndarray:
        """Run tokens through the model after the cached past; returns logits [len(tokens), vocab_width]."""
        return self._feed(self._fed(), tokens)

    def rewind_to(self, n_keep: int) -> None:
        """Keep only the first n_keep cached positions."""
        self.decoder.rewind(self.state, n_keep)
        del self._at[n_keep:]

    # -- Proposer protocol -------------------------------------------------------------------------
    def begin(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """A new stream. A prompt_window arms the one-shot catchup_window for its first feed; positions stay
        absolute in `ids` (sampling noise is keyed by them)."""
        self.ids, self.params = list(prompt_ids), params
        self._restart(0)
        self.catchup_window, self._proposed = self.prompt_window, []

    def _backlog(self) -> tuple[int, list[int]]:
        """(start, ids[start:]): what to feed before the next draft token: the committed tokens not cached yet,
        or the last one again when everything is cached (for its logits), cut by catchup_window / catchup_skip."""
        start, end = self._fed(), len(self.ids)
        window, self.catchup_window = self.catchup_window, None
        if window is not None and end - start > window:
            self._restart(end - window)
            start = end - window
        elif self.catchup_skip is not None and self._at and end - start > self.catchup_skip:
            start = end - self.catchup_skip
        if start >= end:
            start = end - 1
            if self._at:
                self._keep_below(start)
            else:
                self._base = start
        return start, self.ids[start:]

    def _choose(self, logits_row: np.ndarray, position: int) -> tuple[int, np.ndarray | None]:
        """Pick the token at an absolute position: argmax; coupled: argmax(log q + g) with the noise the
        target uses there (q stays home: None); rejection: a draw from q keyed by (seed, position)."""
        if self.params.greedy:
            return int(np.argmax(logits_row)), None
        if self.params.coupled:
            w = coupled_weights(logits_row, self.params)
            return coupled_choice(w, exponential_noise(self.params.seed, position, w.shape[0])), None
        q = logits_to_probs(logits_row[None], self.params)[0]
        return sample_from(q, position_uniforms(self.params.seed, position, STREAM_DRAFT)[0]), q

    def _second(self, logits_row: np.ndarray, position: int, first: int) -> int | None:
        """The runner-up to `first` under _choose's rule at that position (argmax; coupled: argmax of w / E with the
        same noise); None where no other token is possible."""
        if self.params.greedy:
            score = logits_row
        else:
            w = coupled_weights(logits_row, self.params)
            score = w / exponential_noise(self.params.seed, position, w.shape[0])
        kept = score[first]
        score[first] = -np.inf  # argmax of the rest (argpartition over 152k scores took 7 ms, argmax 0.1)
        second = int(np.argmax(score))
        score[first] = kept  # logits_row may be the caller's buffer
        possible = np.isfinite(score[second]) and (self.params.greedy or score[second] > 0)
        return second if second != first and possible else None

    def propose(self, k: int) -> Draft:
        """Draft up to k tokens: `extend`, with the drafts kept out of `ids` until commit says which stay; greedy or
        coupled, the first second_choices tokens carry their runner-up in Draft.alts."""
        base = len(self.ids)
        draft = self.extend(k, self.second_choices if self.params.greedy or self.params.coupled else 0)
        del self.ids[base:]
        self._proposed = draft.ids
        return draft

    # -- stream mode (the pipelined worker): draft ahead, assuming acceptance; truncate on correction --
    def extend(self, n_tokens: int, second_choices: int = 0) -> Draft:
        """Append n_tokens of the draft's own tokens to `ids` (feeding each one), as if all were accepted; the
        first second_choices of them with their runner-up in Draft.alts."""
        base, probs, alts = len(self.ids), [], []
        self.last_catchup_s = 0.0
        for i in range(todo := max(min(n_tokens, self.context_len - base), 0)):
            if i and i >= second_choices and self.params.greedy:  # the rest: each step feeds the last draft token
                fed = len(self.ids) - 1
                self.ids.extend(self.decoder.greedy_steps(self.state, self.ids[-1], todo - i))
                self._at.extend(range(fed, len(self.ids) - 1))
                break
            start, pending = self._backlog()
            started = time.perf_counter() if len(pending) > 2 else 0.0  # (the last draft + the bonus are normal)
            logits = self._feed(start, pending, last_only=True, scratch=True)[-1]
            if started:  # feeding a prompt or a backlog of committed tokens: not a per-token drafting cost
                self.last_catchup_s = time.perf_counter() - started
            tok, q = self._choose(logits, len(self.ids))
            if i < second_choices and (second := self._second(logits, len(self.ids), tok)) is not None:
                alts.append((i, second))
            self.ids.append(tok)
            if q is not None:
                probs.append(q)
        return Draft(ids=self.ids[base:], probs=np.stack(probs) if probs else None, alts=alts)

    def truncate(self, length: int) -> None:
        """Forget tokens from position `length` on (and their cache entries)."""
        del self.ids[length:]
        if length < self.offset:  # cut before the cached window: start the cache afresh there
            self._restart(length)
        else:
            self._keep_below(length)

    def limit_catchup(self, window: int) -> None:
        """Arm catchup_window for the next feed (a re-probe after rounds without drafting stays cheap); a prompt
        window not yet used stays if shorter."""
        self.catchup_window = window if self.catchup_window is None else min(self.catchup_window, window)

    def sync(self, ids: list[int]) -> None:
        """Take the committed text as it is now (another proposer drafted meanwhile): the common prefix stays
        cached; the rest is fed at the next propose."""
        common = next((i for i, (a, b) in enumerate(zip(self.ids, ids)) if a != b), min(len(self.ids), len(ids)))
        self.truncate(common)
        self.ids.extend(ids[common:])
        self._proposed = []

    def commit(self, n_accepted: int, next_token: int) -> None:
        base = len(self.ids)
        self.ids.extend([*self._proposed[:n_accepted], next_token])
        self._keep_below(base + n_accepted)
        self._proposed = []

    def close(self) -> None:
        self._restart(0)
