"""The profile store and its measurements: a profile seeds the engine's Tuning (`load_tuning`); the functions
below measure one cost each. The `hetero-spec profile` driver that runs them is hetero_spec/profile_cmd.py.

Measured on the configured target backend and draft (in process, one request at a time):
- target verification time of a block of k drafts (k + 1 tokens in one pass) after a fixed context;
- the draft's time per token;
- transfer time of one message against its payload (ZeroMQ PAIR over IPC, as the two-process runtime uses);
- prefill time against prompt length;
- the draft's per-token acceptance on calibration prompts (held-out prompts, or --prompts-file);
- measured goodput (committed tokens/s, in process) at a few gammas, next to the model's prediction;
- each draft (the configured one, the extra `--draft` directories, the n-gram lookup when draft.candidates
  names it): time per token, acceptance, and its best gamma and predicted goodput per layout;
- placement (tuning/placement.py): for every layout and core split this machine allows, the measured costs,
  the predicted goodput at its best gamma, and the goodput measured at that gamma;
- one shared target pass against batch size (1, 2, 4, ... up to serving.max_batch: the request scheduler's
  plain round), and the batch size past which throughput stops growing by 10 % per step (recommended_max_batch;
  `serving.max_batch: auto` takes it);
- each target precision this machine runs (onnx on a CPU: fp32, int8, int4): verify line, the draft's cost and
  acceptance against it, best gamma and predicted goodput; the recommended one is taken by
  `target.precision: auto` only with `target.allow_lossy: true`.

Writes PROFILE.yaml (machine, measured points, the fitted CostModel, acceptance, recommended gamma per layout,
measured goodput) and PROFILE.png (goodput against gamma). `speculation: {gamma: auto, profile: PROFILE.yaml}`
uses it.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

from ..errors import ConfigError
from .controller import Tuning
from .cost_model import CostModel


def load_tuning(path: Path | None, source: str = "<config>") -> Tuning:
    """A Tuning seeded by a profile (its cost model and acceptance), or an empty one (learn as it runs)."""
    if path is None:
        return Tuning()
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(source, "speculation.profile", str(path), f"cannot read the profile: {exc}") from None
    try:
        model = CostModel.from_dict(raw["cost_model"])
        a = float(raw["acceptance"]["per_token"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(source, "speculation.profile", str(path),
                          f"not a profile written by `hetero-spec profile` (missing or bad {exc})") from None
    tuning = Tuning(profile=model, prior_acceptance=min(max(a, 0.0), 1.0))
    try:  # the shared-pass costs against batch size, when the profile measured them
        batch = raw.get("batch") or {}
        for b, secs in (batch.get("shared_pass_s") or {}).items():
            tuning.shared.observe(int(b), float(secs))
        if batch.get("recommended_max_batch") is not None:
            tuning.recommended_batch = int(batch["recommended_max_batch"])
        rec = (raw.get("precision") or {}).get("recommended")
        if rec is not None:
            tuning.recommended_precision = str(rec)
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(source, "speculation.profile", str(path), f"bad batch.shared_pass_s ({exc})") from None
    return tuning


def median_s(fn, reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def verify_points(target, prompt: list[int], ks: list[int], reps: int) -> list[tuple[int, float]]:
    state = target.new_state()
    target.prefill(state, prompt)
    base = state.n_cached

    def once(k: int):
        target.verify(state, prompt[-1], [prompt[i % len(prompt)] for i in range(k)], True)
        target.rollback(state, base)

    try:
        return [(k + 1, median_s(lambda k=k: once(k), reps)) for k in ks]
    finally:
        target.release_state(state)


def batch_points(target, prompt: list[int], sizes: list[int], reps: int) -> list[tuple[int, float]]:
    """Median seconds of one shared target pass (`verify_batch`) over B rows of one token each, every row after
    the same cached prompt, for each batch size B (the request scheduler's plain round)."""
    states = []
    for _ in range(max(sizes)):
        state = target.new_state()
        target.prefill(state, prompt)
        states.append(state)
    base = states[0].n_cached

    def once(b: int):
        target.verify_batch([(st, prompt[-1], []) for st in states[:b]], [True] * b)
        for st in states[:b]:
            target.rollback(st, base)

    try:
        return [(b, median_s(lambda b=b: once(b), reps)) for b in sizes]
    finally:
        for st in states:
            target.release_state(st)


def recommended_batch(points: list[tuple[int, float]], gain: float = 1.10) -> int:
    """The largest measured batch size reached while each step up still raised the throughput (B / seconds)
    by `gain` x: beyond it, more rows per pass mostly add waiting."""
    best = points[0][0]
    for (b0, s0), (b1, s1) in zip(points, points[1:]):
        if b1 / s1 < gain * (b0 / s0):
            break
        best = b1
    return best


def decoder_token_s(dec, prompt: list[int], reps: int) -> float:
    """Median time per greedy token of an OnnxDecoder, 8 at a time after the prompt (not counted)."""
    import numpy as np

    st = dec.new_state()
    dec.append(st, prompt)
    base = st.n_past

    def once():
        tok = prompt[-1]
        for _ in range(8):
            tok = int(np.argmax(dec.append(st, [tok])[-1]))
        dec.rewind(st, base)

    return median_s(once, reps) / 8


def transfer_points(sizes: list[int], reps: int) -> list[tuple[int, float]]:
    """One-way time of a message of each size: half a ZeroMQ PAIR round trip over IPC."""
    import tempfile

    import zmq

    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="hetero-spec-profile-") as tmp:
        addr = f"ipc://{tmp}/echo"
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind(addr)
        b.connect(addr)
        stop = threading.Event()

        def echo():
            while not stop.is_set():
                if b.poll(50):
                    b.send(b.recv(copy=False), copy=False)

        th = threading.Thread(target=echo, daemon=True)
        th.start()
        out = []
        for size in sizes:
            payload = os.urandom(size)

            def rt(payload=payload):
                a.send(payload, copy=False)
                a.recv(copy=False)

            out.append((size, median_s(rt, reps) / 2))
        stop.set()
        th.join()
        a.close(0)
        b.close(0)
    ctx.term()
    return out
