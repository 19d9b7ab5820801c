"""Draft worker process: runs the ONNX draft (never torch) and streams proposals to the target over ZeroMQ.

One stream per request (Begin opens it, End closes it; beyond `max_streams` the least recently heard of is closed),
drafted up to `max_ahead` tokens past the committed text and rebased where a Sync differs
(docs/features-two-process.md). It checks its parent pid every loop iteration rather than using Linux's
parent-death signal, which fires when the *thread* that spawned the worker exits (restarts spawn from a short-lived
thread). CURVE keys arrive as one JSON line on stdin (`--keys-stdin`), which only this process can read.

    python -m hetero_spec.runtime.draft_worker --endpoint ipc:///tmp/x.sock --model DIR
"""

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ..draft.onnx_drafter import OnnxDrafter
from ..sampling import SamplingParams
from ..transport.channel import DEFAULT_MAX_MSG_BYTES, Channel, key_fingerprint, worker_keys
from ..transport.protocol import Begin, Control, End, Failure, Ping, Pong, Proposal, Ready, Shutdown, Sync, ids_within

log = logging.getLogger("hetero_spec.draft_worker")

FLUSH_S = 0.002  # longest a drafted token waits to be sent
MAX_STREAMS = 64  # requests drafted for at once (the target side asks for at most serving.max_batch)
#: failed CURVE handshakes in a row that end a remote worker (keys that are not the target's fail every retry, about
#: 0.1 s apart; one broken off by a restarting target does not)
HANDSHAKE_FAILURES = 3


@dataclass
class _Stream:
    """One request's drafting state in the worker: its own draft state on the one loaded model."""

    req_id: int
    gamma: int
    max_ahead: int
    drafting: bool
    drafter: OnnxDrafter
    committed: int      # tokens the target has committed (known from Begin/Sync)
    epoch: int = 0
    base: int = 0       # first position of the current stream that the worker drafted itself
    sent: int = 0       # stream positions below this have been sent
    # the stream was rebased on a correction: its first token goes out alone, at once (the target waits for it)
    rush: bool = False
    # drafted, not sent yet (every token from `sent` on): when their drafting began, its time, their distributions
    unsent_t0: float | None = None
    unsent_s: float = 0.0
    unsent_probs: list = field(default_factory=list)

    def reset_unsent(self) -> None:
        self.unsent_t0, self.unsent_s, self.unsent_probs = None, 0.0, []

    def want(self) -> int:
        """Tokens to draft next: up to a block, within max_ahead past the committed text and the context."""
        if not self.drafting:
            return 0
        drafted = len(self.drafter.ids)
        return max(0, min(self.gamma, self.max_ahead - (drafted - self.committed), self.drafter.context_len - drafted))


def _valid_ids(arrays: list[np.ndarray], vocab: int) -> list[int] | None:
    """The token ids of a Begin/Sync (decode made sure of one 1-D int32 array), or None unless all are in range."""
    return arrays[0].astype(np.int64).tolist() if ids_within(arrays[0], vocab) else None


class Worker:
    """The worker's protocol side. `step()` does one unit of work; `loop()` runs it until Shutdown.
    `clock` is a seam for tests (the send-batching deadline). The drafting methods act on the current stream
    (`cur`: the last one begun, handled or drafted for)."""

    def __init__(self, channel: Channel, drafter: OnnxDrafter, parent_pid: int | None,
                 clock=time.monotonic, max_streams: int = MAX_STREAMS, ready: Ready | None = None):
        """parent_pid None: a remote worker (`hetero-spec draft-worker --connect`): a Shutdown ends the target's
        session only, and each new one gets `ready` again, on the link's handshake, with every old stream closed."""
        self.channel, self.parent_pid, self.ready = channel, parent_pid, ready
        self.model, self.clock = drafter, clock  # the loaded draft; each stream drafts on a state of its own (spawn)
        self.streams: dict[int, _Stream] = {}  # by req_id, least recently heard of first
        self.cur: _Stream | None = None
        self.max_streams = max(1, max_streams)
        self._turn = 0  # round-robin position among the streams that want to draft
        self.running, self.refused = True, False
        self.keys_note = ""  # the fingerprints of this worker's keys, for the refusal's log line
        self._failed_handshakes = 0  # in a row, since the last handshake that succeeded

    def _stream(self, req_id: int) -> _Stream | None:
        """The stream of req_id, made current and moved to the most recently heard of; None if not open."""
        if (stream := self.streams.pop(req_id, None)) is not None:
            self.streams[req_id] = self.cur = stream
        return stream

    def _open(self, msg: Begin, prompt: list[int]) -> None:
        """Begin the stream of msg.req_id on prompt (its old draft state is reused, if it had one)."""
        old = self.streams.pop(msg.req_id, None)
        while len(self.streams) >= self.max_streams:  # evict the least recently heard of
            evicted = self.streams.pop(next(iter(self.streams)))
            log.warning("more than %d streams: closing the stream of request %d", self.max_streams, evicted.req_id)
            evicted.drafter.close()
        drafter = old.drafter if old is not None else self.model.spawn()
        size = len(prompt)
        self.streams[msg.req_id] = self.cur = _Stream(msg.req_id, msg.gamma, msg.max_ahead, msg.drafting, drafter,
                                                      committed=size, base=size, sent=size)
        drafter.begin(prompt, SamplingParams(msg.temperature, msg.top_k, msg.top_p, msg.seed,
                                             sampling="coupled" if msg.coupled else "rejection"))

    def _close(self, req_id: int) -> None:
        stream = self.streams.pop(req_id)
        stream.drafter.close()
        if self.cur is stream:
            self.cur = next(reversed(self.streams.values()), None)

    # -- messages ----------------------------------------------------------------------------------
    def handle(self, msg, arrays: list[np.ndarray]) -> None:
        if isinstance(msg, Begin):
            if (prompt := _valid_ids(arrays, self.model.vocab_width)) and msg.gamma >= 1 and msg.max_ahead >= 1:
                self._open(msg, prompt)
            else:
                self.channel.reject("Begin without a valid prompt, gamma or max_ahead")
        elif isinstance(msg, Sync) and self._stream(msg.req_id) is not None:
            if (tokens := _valid_ids(arrays, self.model.vocab_width)) is not None and msg.pos >= 0:
                self._sync(msg.pos, tokens, msg.epoch)
            else:
                self.channel.reject("Sync without valid token ids")
        elif isinstance(msg, Control) and self._stream(msg.req_id) is not None:
            self.cur.drafting, self.cur.gamma = msg.drafting, max(1, msg.gamma)
        elif isinstance(msg, End) and msg.req_id in self.streams:
            self._close(msg.req_id)
        elif isinstance(msg, Ping):
            self.channel.send(Pong(seq=msg.seq, sent=msg.sent, pid=os.getpid(), dropped=self.channel.dropped))
        elif isinstance(msg, Shutdown):
            if self.parent_pid is None:
                self.end_session()
            else:
                self.running = False
        elif isinstance(msg, (Sync, Control)):  # its stream was evicted (more than max_streams) or has ended
            self.channel.reject(f"{type(msg).__name__} for request {msg.req_id}, which has no stream here")

    def _sync(self, pos: int, tokens: list[int], epoch: int = 0) -> None:
        """Merge committed tokens ids[pos:]; rebase the stream where it diverges. `epoch` is the oldest stream the
        target still accepts: a newer one than the worker's means the target dropped the worker's stream, which
        then starts over (re-sent from the committed length) in that epoch."""
        stream = self.cur
        ids = stream.drafter.ids
        if pos > stream.committed:
            log.warning("Sync at %d but only %d committed tokens are known; ignored", pos, stream.committed)
            return
        diverged = False
        for position, tok in enumerate(tokens, start=pos):
            if position < stream.committed or (position < len(ids) and ids[position] == tok):
                continue
            diverged = True
            if position < len(ids):
                stream.drafter.truncate(position)
            ids.append(tok)
        stream.committed = max(stream.committed, pos + len(tokens))
        if diverged or epoch > stream.epoch:
            if not diverged:  # the target dropped our stream: draft it again in the new epoch
                stream.drafter.truncate(stream.committed)
            stream.epoch = max(stream.epoch + 1, epoch) if diverged else epoch
            stream.base, stream.sent, stream.rush = stream.committed, stream.committed, True
            stream.reset_unsent()

    # -- drafting -----------------------------------------------------------------------------------
    def want_to_draft(self) -> int:
        return 0 if self.cur is None else self.cur.want()

    def draft_once(self, n_tokens: int) -> None:
        """Draft n_tokens onto the stream; they are sent by `flush`, in batches (see `should_flush`)."""
        stream = self.cur
        started = self.clock()
        draft = stream.drafter.extend(n_tokens)
        ended = self.clock()
        if not draft.ids:
            return
        started += stream.drafter.last_catchup_s  # report drafting cost, not the prompt/backlog prefill
        stream.unsent_t0 = started if stream.unsent_t0 is None else stream.unsent_t0
        stream.unsent_s += ended - started
        if draft.probs is not None:
            stream.unsent_probs.extend(draft.probs.astype(np.float32))

    def flush(self) -> None:
        """Send the stream tokens the target has not been sent yet, in one Proposal (when `should_flush` says so)."""
        stream = self.cur
        toks = stream.drafter.ids[stream.sent:]
        arrays = [np.asarray(toks, dtype=np.int32)]
        if not (stream.drafter.params.greedy or stream.drafter.params.coupled):  # rejection sampling: q per token
            if len(stream.unsent_probs) != len(toks):
                log.warning("%d unsent tokens but %d distributions; redrafting them", len(toks),
                            len(stream.unsent_probs))
                stream.drafter.truncate(stream.sent)
                stream.reset_unsent()
                return
            arrays.append(np.stack(stream.unsent_probs))
        start, stream.sent, stream.rush = stream.sent, len(stream.drafter.ids), False
        now = self.clock()
        self.channel.send(Proposal(req_id=stream.req_id, epoch=stream.epoch, base=stream.base, start=start,
                                   draft_s=stream.unsent_s, timed=len(toks), sent=now,
                                   draft_t0=now if stream.unsent_t0 is None else stream.unsent_t0), *arrays)
        stream.reset_unsent()

    def should_flush(self, wanted: int) -> bool:
        """Batch the sends: when the target's next block is complete, when drafting stops at max_ahead (`wanted`
        is 0), otherwise one per FLUSH_S (a slow draft still streams); a message wakes both processes' I/O threads."""
        stream = self.cur
        if stream is None or stream.sent >= len(stream.drafter.ids):
            return False
        if stream.rush or stream.sent < stream.committed + stream.gamma <= len(stream.drafter.ids) or not wanted:
            return True
        return stream.unsent_t0 is not None and self.clock() - stream.unsent_t0 >= FLUSH_S

    def step(self, idle_wait_s: float = 0.2) -> bool:
        """One unit of work: handle a message, send, or draft one token. Waits up to idle_wait_s for a message
        only when there is nothing else to do; False when it did nothing."""
        want = {rid: stream.want() for rid, stream in self.streams.items()}
        if (got := self.channel.recv(0.0 if any(want.values()) else idle_wait_s)) is not None:
            self.handle(*got)
            return True  # drain everything queued before drafting on a possibly stale stream
        for rid, stream in list(self.streams.items()):
            self.cur = stream
            if self.should_flush(want[rid]):
                self.flush()
                return True
        order = [rid for rid, n in want.items() if n]
        if not order:
            return False
        # one token at a time, looking at the socket in between: a correction that arrives mid-block stops
        # drafting on the stale stream at once; streams take turns
        self._turn = (self._turn + 1) % len(order)
        self.cur = self.streams[order[self._turn]]
        self.draft_once(1)
        return True

    def end_session(self) -> None:
        """A remote worker's target went away: close every stream; the next target starts afresh."""
        for rid in list(self.streams):
            self._close(rid)

    def on_link(self, event: str) -> None:
        """A remote worker's link: `connected` (a target's handshake succeeded) announces Ready for a new session;
        `refused` (the target does not admit this worker's key) ends the worker."""
        if event == "connected":
            self._failed_handshakes = 0
            self.end_session()
            self.channel.send(self.ready)
        elif event == "refused":
            log.error("the target at %s refused this worker's CURVE key (%s): it is not in the target's "
                      "runtime.worker_keys; exiting", self.channel.endpoint, self.keys_note)
            self.running, self.refused = False, True
        elif event == "handshake_failed":
            self._failed_handshakes += 1
            if self._failed_handshakes >= HANDSHAKE_FAILURES:
                log.error("the CURVE handshake with the target at %s failed %d times in a row (%s): the keys in "
                          "--keys are not that target's (its server.key differs) or it does not speak CURVE; "
                          "exiting", self.channel.endpoint, self._failed_handshakes, self.keys_note)
                self.running, self.refused = False, True

    def loop(self) -> None:
        while self.running:
            if self.parent_pid is None:
                for event in self.channel.link_events():
                    self.on_link(event)
            elif os.getppid() != self.parent_pid:  # checked every iteration: a getppid() call is ~0.1 us
                log.warning("target process is gone; draft worker exits")
                return
            self.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetero_spec.runtime.draft_worker",
                                     description="hetero_spec draft worker (started by the target process)")
    parser.add_argument("--endpoint", required=True, help="ZeroMQ endpoint the target bound")
    parser.add_argument("--model", required=True, help="exported ONNX draft directory")
    parser.add_argument("--providers", default="CPUExecutionProvider",
                        help="comma-separated execution providers, or draft.providers as a JSON list")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    parser.add_argument("--vocab-width", type=int, default=0, help="target logits width")
    parser.add_argument("--cpus", default="", help="comma-separated CPU ids to pin this process to")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    parser.add_argument("--max-streams", type=int, default=MAX_STREAMS, help="requests drafted for at once")
    parser.add_argument("--prompt-window", type=int, default=0, help="draft.prompt_window (0: the whole prompt)")
    parser.add_argument("--kernels", default="auto", choices=("auto", "onnxruntime", "hetero_spec"),
                        help="runtime.kernels: which kernels run the draft's 4-bit matmuls")
    parser.add_argument("--keys-stdin", action="store_true", help="read the CURVE keys from stdin (one JSON line)")
    parser.add_argument("--max-msg-bytes", type=int, default=DEFAULT_MAX_MSG_BYTES, help="largest frame accepted")
    parser.add_argument("--keys", default="", help="remote worker: directory with client.key_secret and server.key")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("HETERO_SPEC_WORKER_LOG", "WARNING"),
                        format="%(asctime)s draft-worker %(levelname)s %(message)s")
    remote = bool(args.keys)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Ctrl-C at a terminal is the target process's to handle, unless this is a remote worker (its own terminal)
    signal.signal(signal.SIGINT, (lambda *_: sys.exit(0)) if remote else signal.SIG_IGN)
    if args.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    keys = json.loads(sys.stdin.readline()) if args.keys_stdin else (worker_keys(args.keys) if remote else None)
    providers = json.loads(args.providers) if args.providers.startswith("[") else args.providers.split(",")
    with contextlib.closing(Channel.connect(args.endpoint, curve=keys, max_msg_bytes=args.max_msg_bytes,
                                            watch=remote)) as channel:
        try:
            drafter = OnnxDrafter(args.model, providers=providers, threads=args.threads,
                                  vocab_width=args.vocab_width or None, prompt_window=args.prompt_window or None,
                                  kernels=args.kernels)
        except Exception as exc:  # report why, then exit non-zero
            channel.send(Failure(error=f"{type(exc).__name__}: {exc}"))
            time.sleep(0.2)
            return 3
        ready = Ready(pid=os.getpid(), vocab_width=drafter.vocab_width, context_len=drafter.context_len,
                      providers=drafter.decoder.session.get_providers(), fallback=drafter.decoder.provider_notes)
        if not remote:
            channel.send(ready)
        worker = Worker(channel, drafter, None if remote else args.parent_pid or os.getppid(),
                        max_streams=args.max_streams, ready=ready)
        if keys:
            worker.keys_note = (f"this worker's key fingerprint {key_fingerprint(keys['public'])}, the server key "
                                f"it expects {key_fingerprint(keys['server_public'])}")
        worker.loop()
    return 2 if worker.refused else 0


if __name__ == "__main__":
    sys.exit(main())
