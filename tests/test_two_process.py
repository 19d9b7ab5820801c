"""Two-process runtime with real worker processes: identity, crash recovery without orphans (with the
controller held on or off), garbage frames, clean shutdown. Nothing here asserts a wall-clock outcome: the
deterministic protocol tests (overlap, corrections, every death state, fuzz) are in test_pipelined_mem.py,
the controller's decisions in test_controller.py, and speed in `hetero-spec bench`."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from hetero_spec import Engine
from hetero_spec.config import build_config
from hetero_spec.errors import ConfigError
from hetero_spec.runtime.supervisor import WorkerStartError
from tests.conftest import hf_greedy

PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [40, 41, 42, 43, 44, 40, 41, 42]]


def _cfg(target, draft, **runtime):
    # a generous heartbeat: on a loaded machine a slow Pong must not count as a hung worker here
    rt = {"mode": "two_process", "pin_cpus": False, "heartbeat_s": 120.0, **runtime}
    return {"target": {"model": str(target), "dtype": "float32", "device": "cpu"},
            "draft": {"kind": "onnx", "model": str(draft)}, "runtime": rt}


def _children(pid: int) -> list[int]:
    """Live (non-zombie) child processes of pid, read from /proc."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(entry.name))
    return kids


@pytest.fixture(scope="module")
def pipelined(llama_target, llama_copy_onnx):
    eng = Engine.from_config(_cfg(llama_target, llama_copy_onnx))
    yield eng
    eng.close()


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_two_process_greedy_identity(pipelined, llama_target, gamma):
    for prompt in PROMPTS:
        out = pipelined.generate(prompt, max_new_tokens=40, gamma=gamma)
        assert out.token_ids == hf_greedy(llama_target, prompt, 40)
        assert out.stats["acceptance_rate"] >= 0.98


def test_two_process_identity_with_rejections(llama_target, llama_random_onnx):
    """An unrelated draft: nearly every block is corrected, epochs advance, output stays identical."""
    with Engine.from_config(_cfg(llama_target, llama_random_onnx)) as eng:
        for gamma in (2, 5):
            for prompt in PROMPTS:
                out = eng.generate(prompt, max_new_tokens=40, gamma=gamma)
                assert out.token_ids == hf_greedy(llama_target, prompt, 40)
                assert out.stats["drafted"] > 0


def test_prompt_window_reaches_the_worker_and_output_stays_identical(llama_target, llama_random_onnx):
    """draft.prompt_window: the worker is started with it (its command line), and output with a draft that
    reads only the prompt's last 3 tokens is identical to target-only."""
    cfg = _cfg(llama_target, llama_random_onnx)
    cfg["draft"]["prompt_window"] = 3
    with Engine.from_config(cfg) as eng:
        pid = eng.source.sup.current().proc.pid
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--prompt-window") + 1] == b"3"
        for prompt in PROMPTS:
            out = eng.generate(prompt, max_new_tokens=30, gamma=3)
            assert out.token_ids == hf_greedy(llama_target, prompt, 30) and out.stats["drafted"] > 0


def test_stop_token_and_max_new_tokens_inside_block(pipelined, llama_target):
    prompt = PROMPTS[0]
    free = hf_greedy(llama_target, prompt, 40)
    pos = next(i for i in range(4, 40) if free[i] not in free[:i] and free[i] != 0)
    out = pipelined.generate(prompt, max_new_tokens=40, gamma=8, stop_token_ids=[free[pos]])
    assert out.token_ids == free[:pos + 1] and out.finish_reason == "stop"
    out = pipelined.generate(prompt, max_new_tokens=7, gamma=8)
    assert out.token_ids == free[:7] and out.finish_reason == "length"


def test_sigkill_draft_mid_generation(llama_target, llama_copy_onnx, slow_draft):
    """The request finishes with identical output, the dead worker leaves no process behind,
    and a new worker comes back."""
    slow_draft(3.0)
    cfg = _cfg(llama_target, llama_copy_onnx, restart_backoff_s=0.1)
    prompt = PROMPTS[0]
    ref = hf_greedy(llama_target, prompt, 60)
    before = set(_children(os.getpid()))
    eng = Engine.from_config(cfg)
    try:
        sup = eng.source.sup
        first_pid = sup.current().proc.pid
        from hetero_spec.metrics import Stats

        stats = Stats()
        killed = False
        for _piece in eng.stream(prompt, max_new_tokens=60, gamma=3, stats=stats):
            if not killed and stats.new_tokens >= 8:
                os.kill(first_pid, signal.SIGKILL)
                killed = True
        assert killed
        out = eng.generate(prompt, max_new_tokens=60, gamma=3)  # the engine still works
        assert out.token_ids == ref
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            w = sup.current()
            if w is not None and w.proc.pid != first_pid:
                break
            time.sleep(0.1)
        assert sup.current() is not None and sup.current().proc.pid != first_pid
        assert sup.restarts >= 1 and sup.failures >= 1
        assert first_pid not in _children(os.getpid())
        assert eng.health()["draft"] == "ok"
    finally:
        eng.close()
    assert set(_children(os.getpid())) <= before


def test_streamed_tokens_identical_after_kill(llama_target, llama_copy_onnx, slow_draft):
    slow_draft(3.0)
    cfg = _cfg(llama_target, llama_copy_onnx, restart_backoff_s=0.1)
    prompt = PROMPTS[1]
    before = set(_children(os.getpid()))
    with Engine.from_config(cfg) as eng:
        from hetero_spec.metrics import Stats

        stats = Stats()
        pid = eng.source.sup.current().proc.pid
        text = ""
        for piece in eng.stream(prompt, max_new_tokens=50, gamma=4, stats=stats):
            text += piece
            if stats.new_tokens >= 6 and eng.source.sup.failures == 0:
                os.kill(pid, signal.SIGKILL)
        ref = hf_greedy(llama_target, prompt, 50)
        assert text == eng.tokenizer.decode(ref)
        assert stats.extra["draft_failures"] == 1
    assert set(_children(os.getpid())) <= before


@pytest.mark.parametrize("state", ["on", "off", "begin"])
def test_sigkill_in_every_state(llama_target, llama_copy_onnx, state):
    """The controller holds speculation on (or off: the worker drafts in the background) and the worker is
    SIGKILLed mid-request ("begin": just before the request starts, so Begin goes to a dead worker). The request
    finishes with identical output, no ZMQError, and the worker comes back."""
    from hetero_spec.metrics import Stats
    from tests.fixtures.memworker import FixedController

    cfg = _cfg(llama_target, llama_copy_onnx, restart_backoff_s=0.05)
    ref = hf_greedy(llama_target, PROMPTS[0], 40)
    ctl = FixedController.factory("on" if state == "begin" else state)
    with Engine.from_config(cfg, controller=ctl) as eng:
        sup = eng.source.sup
        pid = sup.current().proc.pid
        if state == "begin":
            os.kill(pid, signal.SIGKILL)
            sup.current().proc.wait()
        stats, killed = Stats(), state == "begin"
        for _ in eng.stream(PROMPTS[0], max_new_tokens=40, gamma=3, stats=stats):
            if stats.new_tokens >= 8 and not killed:  # once: a dying worker may be reaped between a check and a kill
                os.kill(pid, signal.SIGKILL)
                killed = True
        out = eng.generate(PROMPTS[0], max_new_tokens=40, gamma=3)
        assert out.token_ids == ref and stats.new_tokens == len(ref)
        eng.health()  # notices a death the request did not need to look at
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (sup.current() is None or sup.current().proc.pid == pid):
            time.sleep(0.05)
        assert sup.current() is not None and sup.current().proc.pid != pid
        assert sup.failures >= 1 and eng.health()["draft"] == "ok"
        assert eng.generate(PROMPTS[0], max_new_tokens=40, gamma=3).token_ids == ref
        assert not _alive(pid)


def test_garbage_frames_at_the_worker(llama_target, llama_copy_onnx):
    """Malformed frames sent to the worker are dropped and counted there; the request is unaffected.
    (Garbage at the target: the 1000-frame fuzz in test_pipelined_mem.py and test_transport.py.)"""
    with Engine.from_config(_cfg(llama_target, llama_copy_onnx)) as eng:
        w = eng.source.sup.current()
        w.channel.sock.send_multipart([b"\xc1 not msgpack"])  # garbage at the worker
        w.channel.sock.send_multipart([b"\x81\xa1t\xa5bogus"])
        out = eng.generate(PROMPTS[0], max_new_tokens=30, gamma=3)
        assert out.token_ids == hf_greedy(llama_target, PROMPTS[0], 30)
        assert out.stats["extra"]["dropped_messages"] == 0
        health = eng.health()
        assert health["draft"] == "ok" and health["worker_dropped"] == 2


def test_worker_start_failure_is_clear(tmp_path, llama_target, llama_copy_onnx):
    broken = tmp_path / "broken-onnx"
    broken.mkdir()
    for f in llama_copy_onnx.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    for graph in broken.glob("*.onnx"):  # model.onnx and model.runner.onnx (draft/export.add_runner_graph)
        graph.write_bytes(b"not an onnx model")
    before = set(_children(os.getpid()))
    with pytest.raises(WorkerStartError, match="failed to load"):
        Engine.from_config(_cfg(llama_target, broken))
    assert set(_children(os.getpid())) <= before


def test_two_process_needs_an_onnx_draft(llama_target):
    with pytest.raises(ConfigError, match="runtime.mode"):
        Engine.from_config(build_config({"target": {"model": str(llama_target)},
                                         "draft": {"kind": "ngram"}, "runtime": {"mode": "two_process"}}))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_cli_killed_leaves_no_orphan(tmp_path, llama_target, llama_copy_onnx, sig, slow_draft):
    """SIGTERM / Ctrl-C shut the worker down through the engine; even SIGKILL of the CLI leaves no
    orphan, because the worker exits when its parent is gone. (A draft slowed to 50 ms a token keeps the request
    running while the signal arrives.)"""
    slow_draft(50.0)
    import subprocess
    import sys

    cfg = tmp_path / "tp.yaml"
    cfg.write_text(f"target: {{model: {llama_target}, dtype: float32}}\n"
                   f"draft: {{kind: onnx, model: {llama_copy_onnx}}}\n"
                   "runtime: {mode: two_process, pin_cpus: false}\n")
    proc = subprocess.Popen([sys.executable, "-m", "hetero_spec.cli", "generate", "--config", str(cfg),
                             "--prompt", "def f(x):", "--max-new-tokens", "80"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    workers: list[int] = []
    while time.monotonic() < deadline and not workers:
        workers = _children(proc.pid)
        time.sleep(0.1)
    assert workers, "the draft worker never started"
    deadline = time.monotonic() + 180  # generous: on a loaded machine the target alone takes a while to load
    _read_until(proc.stdout, b"def f(x):", deadline)  # the prompt echo: the request is validated
    _read_until(proc.stdout, None, deadline)  # ... and at least one more byte: generation is under way
    proc.send_signal(sig)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.1)
    alive = [w for w in workers if _alive(w)]
    assert alive == [], f"orphaned draft worker(s) {alive} after {sig!r}"


def _alive(pid: int) -> bool:
    """True while pid runs (a zombie or a vanished process is not alive)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _read_until(stream, marker: bytes | None, deadline: float) -> bytes:
    """Read a pipe until `marker` (or, with None, any one byte) arrives; an explicit event, not a sleep."""
    import select

    got = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], 0.5)
        if ready:
            b = os.read(stream.fileno(), 1)
            if not b:
                break
            got += b
            if marker is None or got.endswith(marker):
                return got
    raise AssertionError(f"never saw {marker!r} on the CLI's output (got {got!r})")
