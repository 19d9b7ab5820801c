"""Draft worker process: runs the ONNX draft and streams proposals to the target over ZeroMQ.

It drafts ahead of the target, assuming its own tokens will be accepted, up to `max_ahead` tokens past
the last committed position it knows. Every Sync from the target carries the newly committed tokens;
where they differ from the worker's stream, the worker truncates its stream and KV cache there, starts a
new epoch, and drafts on from the corrected context.

Never imports torch. Exits by itself when the target process goes away (its parent pid changes; checked
every loop iteration, at least every 0.2 s), on Shutdown, or on SIGTERM/SIGINT. (Linux's parent-death
signal is not used: it fires when the *thread* that spawned the worker exits, and restarts spawn from a
short-lived thread.)

    python -m hetero_spec.runtime.draft_worker --endpoint ipc:///tmp/x.sock --model DIR
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..draft.onnx_drafter import OnnxDrafter
from ..sampling import SamplingParams
from ..transport.channel import Channel
from ..transport.protocol import (Begin, Control, End, Failure, Ping, Pong, Proposal, Ready, Shutdown,
                                  Sync)

log = logging.getLogger("hetero_spec.draft_worker")


@dataclass
class _Request:
    req_id: int
    gamma: int
    max_ahead: int
    drafting: bool
    committed: int      # tokens the target has committed (known from Begin/Sync)
    epoch: int = 0
    base: int = 0       # first position of the current stream that the worker drafted itself
    sent: int = 0       # stream positions below this have been sent


class Worker:
    def __init__(self, channel: Channel, drafter: OnnxDrafter, parent_pid: int, delay_s: float = 0.0,
                 branches: bool = True):
        self.ch, self.drafter, self.parent_pid, self.delay_s = channel, drafter, parent_pid, delay_s
        self.req: _Request | None = None
        self.running = True
        self.use_branches = branches
        # (position, token) -> pre-drafted continuation if the target puts `token` at `position`
        self.branches: dict[tuple[int, int], tuple[list[int], list, int]] = {}
        self.branch_hits = 0

    # -- messages ----------------------------------------------------------------------------------
    def handle(self, msg, arrays: list[np.ndarray]) -> None:
        if isinstance(msg, Begin):
            if len(arrays) != 1 or arrays[0].ndim != 1 or arrays[0].size == 0:
                log.warning("Begin without a prompt frame; ignored")
                return
            prompt = arrays[0].astype(np.int64).tolist()
            self.drafter.begin(prompt, SamplingParams(msg.temperature, msg.top_k, msg.top_p, msg.seed))
            self.req = _Request(msg.req_id, msg.gamma, msg.max_ahead, msg.drafting, committed=len(prompt),
                                base=len(prompt), sent=len(prompt))
        elif isinstance(msg, Sync) and self.req is not None and msg.req_id == self.req.req_id:
            self._sync(msg.pos, arrays[0].astype(np.int64).tolist() if arrays else [])
        elif isinstance(msg, Control) and self.req is not None and msg.req_id == self.req.req_id:
            self.req.drafting, self.req.gamma = msg.drafting, max(1, msg.gamma)
        elif isinstance(msg, End) and self.req is not None and msg.req_id == self.req.req_id:
            self.req = None
        elif isinstance(msg, Ping):
            self.ch.send(Pong(seq=msg.seq, sent=msg.sent, pid=os.getpid(), dropped=self.ch.dropped))
        elif isinstance(msg, Shutdown):
            self.running = False

    def _sync(self, pos: int, tokens: list[int]) -> None:
        """Merge committed tokens ids[pos:]; rebase the stream where it diverges (onto a pre-drafted
        branch when the target's correction is the one the worker guessed)."""
        req, ids = self.req, self.drafter.ids
        if pos > req.committed:
            log.warning("Sync at %d but only %d committed tokens are known; ignored", pos, req.committed)
            return
        diverged = False
        branches, self.branches = self.branches, {}
        for p, tok in enumerate(tokens, start=pos):
            if p < req.committed:
                continue
            if p < len(ids) and ids[p] == tok:
                continue
            hit = branches.get((p, tok)) if p == pos + len(tokens) - 1 else None
            diverged = True
            if hit is not None:  # the correction is the last committed token: take the branch
                self.drafter.adopt(p, tok, hit)
                self.branch_hits += 1
                break
            if p < len(ids):
                self.drafter.truncate(p)
            ids.append(tok)
        req.committed = max(req.committed, pos + len(tokens))
        for p in [p for p in self.drafter.alts if p < req.committed]:
            del self.drafter.alts[p]
        if diverged:
            req.epoch += 1
            req.base = req.sent = req.committed

    # -- drafting -----------------------------------------------------------------------------------
    def want_to_draft(self) -> int:
        req = self.req
        if req is None or not req.drafting:
            return 0
        ahead = len(self.drafter.ids) - req.committed
        room = self.drafter.context_len - len(self.drafter.ids)
        return max(0, min(req.gamma, req.max_ahead - ahead, room))

    def draft_once(self, n: int) -> None:
        req = self.req
        t0 = time.monotonic()
        draft = self.drafter.extend(n)
        if self.delay_s:
            time.sleep(self.delay_s * len(draft.ids))  # test-only: an artificially slow draft
        t1 = time.monotonic()
        if not draft.ids:
            return
        t0 += self.drafter.last_catchup_s  # report drafting cost, not the prompt/backlog prefill
        arrays = [np.asarray(draft.ids, dtype=np.int32)]
        if draft.probs is not None:
            arrays.append(draft.probs.astype(np.float32))
        start = req.sent
        req.sent = start + len(draft.ids)
        self.ch.send(Proposal(req_id=req.req_id, epoch=req.epoch, base=req.base, start=start,
                              draft_s=t1 - t0, draft_t0=t0, sent=time.monotonic()), *arrays)

    def pre_draft_branch(self) -> bool:
        """Idle time (at max_ahead, waiting for the target): pre-draft the continuation after the
        draft's runner-up token at the earliest speculative position without one. Greedy only."""
        req, d = self.req, self.drafter
        if not self.use_branches or req is None or not req.drafting or not d.params.greedy:
            return False
        # the block under verification and its bonus position: where the next correction will land
        for p in range(req.committed, min(len(d.ids), req.committed + req.gamma + 1)):
            alt = d.alts.get(p)
            if alt is None or (p, alt) in self.branches:
                continue
            # a message (most likely the target's Sync) ends the branch early: answering it comes first
            self.branches[(p, alt)] = d.branch(p, alt, req.gamma, stop=lambda: self.ch.sock.poll(0) != 0)
            return True
        return False

    def flush(self) -> None:
        """Send stream tokens the target has not been sent yet (after adopting a branch)."""
        req = self.req
        if req is None or req.sent >= len(self.drafter.ids):
            return
        toks = self.drafter.ids[req.sent:]
        start = req.sent
        req.sent = len(self.drafter.ids)
        now = time.monotonic()
        self.ch.send(Proposal(req_id=req.req_id, epoch=req.epoch, base=req.base, start=start, draft_s=0.0,
                              draft_t0=now, sent=now, branch=True), np.asarray(toks, dtype=np.int32))

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def loop(self) -> None:
        while self.running:
            if not self.parent_alive():  # checked every iteration: a getppid() call is ~0.1 us
                log.warning("target process is gone; draft worker exits")
                return
            n = self.want_to_draft()
            busy = n or (self.req is not None and self.req.drafting and self.drafter.params.greedy
                         and self.use_branches and len(self.branches) <= self.req.gamma)
            got = self.ch.recv(0.0 if busy else 0.2)
            if got is not None:
                self.handle(*got)
                continue  # drain everything queued before drafting on a possibly stale stream
            if self.req is not None and self.req.sent < len(self.drafter.ids):
                self.flush()
                continue
            if not n and self.pre_draft_branch():
                continue
            if n:
                # one token at a time, looking at the socket in between: a correction that arrives
                # mid-block stops drafting on the stale stream at once, and the target receives each
                # token (and its timing) as soon as it exists
                self.draft_once(1)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hetero_spec.runtime.draft_worker",
                                description="hetero_spec draft worker (started by the target process)")
    p.add_argument("--endpoint", required=True, help="ZeroMQ endpoint the target bound")
    p.add_argument("--model", required=True, help="exported ONNX draft directory")
    p.add_argument("--providers", default="CPUExecutionProvider", help="comma-separated execution providers")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    p.add_argument("--vocab-width", type=int, default=0, help="target logits width")
    p.add_argument("--cpus", default="", help="comma-separated CPU ids to pin this process to")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    p.add_argument("--delay-ms", type=float, default=0.0, help="test only: sleep per drafted token")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=os.environ.get("HETERO_SPEC_WORKER_LOG", "WARNING"),
                        format="%(asctime)s draft-worker %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    ch = Channel.connect(args.endpoint)
    try:
        try:
            drafter = OnnxDrafter(args.model, providers=args.providers.split(","), threads=args.threads,
                                  vocab_width=args.vocab_width or None)
        except Exception as exc:  # report why, then exit non-zero
            ch.send(Failure(error=f"{type(exc).__name__}: {exc}"))
            time.sleep(0.2)
            return 3
        ch.send(Ready(pid=os.getpid(), vocab_width=drafter.vocab_width, context_len=drafter.context_len,
                      providers=args.providers.split(",")))
        garbage = os.environ.get("HETERO_SPEC_TEST_GARBAGE", "")
        for junk in garbage.split(",") if garbage else []:  # test only: malformed frames at the target
            ch.sock.send_multipart([junk.encode(), b"x"] if junk.startswith("two") else [junk.encode()])
        Worker(ch, drafter, args.parent_pid or os.getppid(), args.delay_ms / 1000.0).loop()
    except KeyboardInterrupt:
        pass
    finally:
        ch.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
