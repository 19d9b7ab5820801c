"""The profile store and its measurements: a profile seeds the engine's Tuning (`load_tuning`); the functions
below measure one cost each. The `hetero-spec profile` driver that runs them, and writes PROFILE.yaml and
PROFILE.png, is hetero_spec/profile_cmd.py; what it measures: docs/features-tuning.md.
"""

import os
import statistics
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import ConfigError
from .controller import MEASURED_AFTER, Tuning
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
        for rows, secs in (batch.get("shared_pass_s") or {}).items():
            tuning.shared.observe(int(rows), float(secs))
        if (most := batch.get("recommended_max_batch")) is not None:
            tuning.recommended_batch = int(most)
        if (precision := (raw.get("precision") or {}).get("recommended")) is not None:
            tuning.recommended_precision = str(precision)
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(source, "speculation.profile", str(path), f"bad batch.shared_pass_s ({exc})") from None
    return tuning


def seconds_of(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def median_s(run, reps: int) -> float:
    run()  # warm
    return statistics.median(seconds_of(run) for _ in range(reps))


@contextmanager
def prefilled(target, prompt: list[int], rows: int = 1):
    """`rows` target states after the same prompt (released afterwards), and the length to roll them back to."""
    states = []
    try:
        for _ in range(rows):
            states.append(target.new_state())
            target.prefill(states[-1], prompt)
        yield states, states[0].n_cached
    finally:
        for state in states:
            target.release_state(state)


def verify_once(target, state, prompt: list[int], base: int, k: int) -> None:
    """One verification of k drafts (the prompt's tokens again) after the cached prompt, rolled back."""
    target.verify(state, prompt[-1], [prompt[i % len(prompt)] for i in range(k)], True)
    target.rollback(state, base)


def verify_points(target, prompt: list[int], drafts: list[int], reps: int) -> list[tuple[int, float]]:
    """Median seconds of one verification of k drafts (k + 1 tokens) after the cached prompt, for each k."""
    with prefilled(target, prompt) as ([state], base):
        return [(k + 1, median_s(lambda k=k: verify_once(target, state, prompt, base, k), reps)) for k in drafts]


CURVE_K = 8  # gamma auto without a profile or placement: the verify curve is measured at start up to this k


def seed_verify_curve(tuning: Tuning, target, drafts: range = range(CURVE_K + 1), reps: int = MEASURED_AFTER,
                      prompt_len: int = 32) -> dict[int, float]:
    """Time `reps` verifications of k drafts for each k and give each to `tuning` as a pass it saw, so gamma auto
    knows the curve's shape (not a line: docs/features-tuning.md) from its first round. Returns k -> seconds."""
    prompt = [1 + i % 64 for i in range(prompt_len)]
    with prefilled(target, prompt) as ([state], base):
        verify_once(target, state, prompt, base, 0)  # a warm-up, untimed
        for k in drafts:
            for _ in range(reps):
                tuning.observe_verify(k, seconds_of(lambda k=k: verify_once(target, state, prompt, base, k)))
    return {k: tuning.measured[k] for k in drafts}


def batch_points(target, prompt: list[int], sizes: list[int], reps: int) -> list[tuple[int, float]]:
    """Median seconds of one shared target pass (`verify_batch`: the scheduler's plain round) over B rows of one
    token each after the same cached prompt, for each batch size B."""
    with prefilled(target, prompt, max(sizes)) as (states, base):
        def once(rows: int):
            target.verify_batch([(state, prompt[-1], []) for state in states[:rows]], [True] * rows)
            for state in states[:rows]:
                target.rollback(state, base)
        return [(rows, median_s(lambda rows=rows: once(rows), reps)) for rows in sizes]


def recommended_batch(points: list[tuple[int, float]], gain: float = 1.10) -> int:
    """The largest batch size up to which each step raised throughput (B / s) `gain` x: beyond, rows mostly wait."""
    best = points[0][0]
    for (b0, s0), (b1, s1) in zip(points, points[1:]):
        if b1 / s1 < gain * (b0 / s0):
            break
        best = b1
    return best


def decoder_token_s(dec, prompt: list[int], reps: int) -> float:
    """Median time per greedy token of an OnnxDecoder, 8 at a time after the prompt (not counted)."""
    import numpy as np
    state = dec.new_state()
    dec.append(state, prompt)
    base = state.n_past

    def once():
        tok = prompt[-1]
        for _ in range(8):
            tok = int(np.argmax(dec.append(state, [tok])[-1]))
        dec.rewind(state, base)
    return median_s(once, reps) / 8


def step_overhead_s(dec, prompt: list[int], reps: int) -> tuple[float, float] | None:
    """(one greedy step through OnnxDecoder.append, the session's own run of it): median seconds of each. The run is
    timed on the binding the step leaves bound (the same token, position and cache), so the difference is what our
    Python adds to a step. None for a decoder without the shared-buffer layout (its steps bind nothing)."""
    if not dec.shared:
        return None
    state = dec.new_state()
    dec.append(state, prompt)
    base = state.n_past

    def step():
        dec.append(state, [prompt[-1]])
        dec.rewind(state, base)
    step_s = median_s(step, reps)
    return step_s, median_s(lambda: dec.session.run_with_iobinding(state.binding), reps)


def beside(background, measure_fn):
    """measure_fn() while background() runs in a loop in another thread (ONNX Runtime, torch and ZeroMQ release
    the GIL while they work, so the two run on separate cores, as the worker and the target do)."""
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            background()
    thread = threading.Thread(target=loop, name="hetero-spec-beside", daemon=True)
    thread.start()
    try:
        return measure_fn()
    finally:
        stop.set()
        thread.join()


def transfer_points(sizes: list[int], reps: int) -> list[tuple[int, float]]:
    """One-way time of a message of each size: half a ZeroMQ PAIR round trip over IPC."""
    import tempfile
    import zmq
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="hetero-spec-profile-") as tmp:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind(f"ipc://{tmp}/echo")
        b.connect(f"ipc://{tmp}/echo")

        def echo():
            if b.poll(50):
                b.send(b.recv(copy=False), copy=False)

        def round_trip(payload: bytes) -> None:
            a.send(payload, copy=False)
            a.recv(copy=False)
        out = beside(echo, lambda: [(n, median_s(lambda p=os.urandom(n): round_trip(p), reps) / 2) for n in sizes])
        a.close(0)
        b.close(0)
    ctx.term()
    return out
