"""Lifecycle: a dropped Engine shuts its worker down; the worker ignores SIGINT (the parent decides);
generate after close() is an error; two CURVE engines in one process at once; each engine's sockets and
logs live in its own private directory, removed on close."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from hetero_spec import Engine
from hetero_spec.errors import EngineClosedError
from tests.conftest import hf_greedy

PROMPT = [5, 17, 33, 2, 99, 100, 7]


def _cfg(target, draft, **runtime):
    rt = {"mode": "two_process", "pin_cpus": False, "heartbeat_s": 120.0, **runtime}
    return {"target": {"model": str(target), "dtype": "float32", "device": "cpu"},
            "draft": {"kind": "onnx", "model": str(draft)}, "runtime": rt}


def _wait_dead(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_dropped_engine_shuts_its_worker_down(llama_target, llama_copy_onnx):
    eng = Engine.from_config(_cfg(llama_target, llama_copy_onnx))
    pid = eng.source.sup.current().proc.pid
    private = eng.source.sup._server.dir
    del eng
    gc.collect()
    assert _wait_dead(pid), "the worker outlived its Engine"
    assert not os.path.exists(private)


def test_worker_ignores_sigint_and_close_then_generate_is_an_error(llama_target, llama_copy_onnx):
    eng = Engine.from_config(_cfg(llama_target, llama_copy_onnx))
    w = eng.source.sup.current()
    os.kill(w.proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group at a terminal
    out = eng.generate(PROMPT, max_new_tokens=20, gamma=3)
    assert w.proc.poll() is None and eng.source.sup.current() is w and eng.source.sup.failures == 0
    assert out.token_ids == hf_greedy(llama_target, PROMPT, 20)
    eng.close()
    assert _wait_dead(w.proc.pid)
    with pytest.raises(EngineClosedError, match="closed"):
        eng.generate(PROMPT, max_new_tokens=5)
    with pytest.raises(EngineClosedError):
        list(eng.stream(PROMPT, max_new_tokens=5))
    with pytest.raises(EngineClosedError):
        eng.health()
    eng.close()  # twice is fine


def test_in_process_close_then_generate_is_an_error(llama_target):
    eng = Engine.from_config({"target": {"model": str(llama_target), "dtype": "float32"}, "draft": {"kind": "ngram"}})
    eng.close()
    with pytest.raises(EngineClosedError):
        eng.generate(PROMPT, max_new_tokens=5)


def test_two_curve_engines_generate_at_once_with_private_dirs(llama_target, llama_copy_onnx):
    """TCP always uses CURVE (ephemeral keys per worker, over the worker's stdin). Two such engines in
    one process each have their own context and authenticator, so they do not collide."""
    ref = hf_greedy(llama_target, PROMPT, 24)
    engines = [Engine.from_config(_cfg(llama_target, llama_copy_onnx, transport="tcp")) for _ in range(2)]
    try:
        dirs = [e.source.sup._server.dir for e in engines]
        assert dirs[0] != dirs[1] and all(os.stat(d).st_mode & 0o777 == 0o700 for d in dirs)
        assert all(sorted(os.listdir(d)) == ["worker-1.log"] for d in dirs)  # tcp: no socket file
        for e in engines:
            assert e.source.sup.current().channel.endpoint.startswith("tcp://127.0.0.1:")
        outs: dict[int, list[int]] = {}
        start = threading.Barrier(2)

        def run(i):
            start.wait()
            outs[i] = engines[i].generate(PROMPT, max_new_tokens=24, gamma=3).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert outs == {0: ref, 1: ref}
        # the worker's keys came over its stdin: neither argv nor the environment holds a secret
        for e in engines:
            pid = e.source.sup.current().proc.pid
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert b"--keys-stdin" in cmdline and b"CURVE" not in environ
    finally:
        for e in engines:
            e.close()
    assert not any(os.path.exists(d) for d in dirs)


def test_ipc_socket_and_log_are_in_the_private_dir(llama_target, llama_copy_onnx):
    with Engine.from_config(_cfg(llama_target, llama_copy_onnx)) as eng:
        d = eng.source.sup._server.dir
        assert sorted(os.listdir(d)) == ["worker-1.log", "worker-1.sock"]
        assert eng.source.sup.current().channel.endpoint == f"ipc://{d}/worker-1.sock"
    assert not os.path.exists(d)


def test_configured_curve_keys_beyond_loopback(tmp_path, llama_target, llama_copy_onnx, capsys):
    """`hetero-spec keys` makes the key directory; with runtime.curve_keys a TCP link uses those keys
    (here on loopback, the only address a test can rely on), and the worker gets the client key."""
    from hetero_spec.cli import main
    from hetero_spec.errors import ConfigError
    from hetero_spec.transport.channel import CurveKeys

    keys_dir = tmp_path / "keys"
    assert main(["keys", "--out", str(keys_dir)]) == 0
    assert os.stat(keys_dir).st_mode & 0o777 == 0o700
    assert main(["keys", "--out", str(keys_dir)]) == 2  # never overwrite keys
    assert "already holds keys" in capsys.readouterr().err
    keys = CurveKeys.load(keys_dir)
    with Engine.from_config(_cfg(llama_target, llama_copy_onnx, transport="tcp", curve_keys=str(keys_dir))) as eng:
        assert eng.generate(PROMPT, max_new_tokens=12, gamma=3).token_ids == hf_greedy(llama_target, PROMPT, 12)
        server = eng.source.sup._server
        assert server._keys == {keys.client_public}
    with pytest.raises(ConfigError, match="runtime.host"):
        Engine.from_config(_cfg(llama_target, llama_copy_onnx, transport="tcp", host="0.0.0.0"))
    with pytest.raises(ConfigError, match="runtime.curve_keys.*hetero-spec keys"):
        Engine.from_config(_cfg(llama_target, llama_copy_onnx, transport="tcp", curve_keys=str(tmp_path / "none")))


def test_a_failed_re_placement_marks_the_engine_failed(llama_target, monkeypatch):
    """The new layout would not start, nor would the old one again: no model is loaded, so every call raises
    EngineClosedError saying why (not AttributeError on a target of None), and the server answers 503."""
    import httpx

    from hetero_spec import engine as engine_mod
    from hetero_spec.serve import create_app
    from tests.test_serve import Server

    eng = Engine.from_config({"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
                              "draft": {"kind": "none"}, "runtime": {"mode": "in_process"}})
    srv = Server(create_app(eng, "tiny", own_engine=False))
    try:
        class Layout:
            def label(self):
                return "two_process 1+1"

        class Replacer:
            def decide(self, *args):
                return Layout(), "the draft pays", []

        def no_start(config):
            raise RuntimeError("no cores left")

        eng._replacer = Replacer()
        monkeypatch.setattr(engine_mod.pl, "apply", lambda auto, best: "new layout")
        monkeypatch.setattr(eng, "_build", no_start)
        eng.between_requests()  # what the loop calls when no request runs: logged, not raised
        assert eng.target is None and eng.failure is not None
        for call in (lambda: eng.generate([5, 6, 7], max_new_tokens=2), lambda: eng.health(1.0),
                     lambda: eng.prompt_ids("x")):
            with pytest.raises(EngineClosedError, match="re-placement to two_process 1\\+1 failed.*no cores left"):
                call()
        health = httpx.get(srv.url + "/health", timeout=30)
        assert health.status_code == 503 and "re-placement" in health.json()["reason"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "re-placement" in r.json()["error"]["message"]
    finally:
        srv.close()
        eng.close()


def test_two_threads_that_see_one_worker_die_count_and_restart_it_once(monkeypatch):
    """DraftSupervisor.fail checks and acts under its lock: eight threads failing one worker at once (all inside
    fail() before the first has reaped it) count one failure and start one restart thread."""
    from types import SimpleNamespace

    from hetero_spec.config import DraftConfig, RuntimeConfig
    from hetero_spec.runtime import supervisor as sup_mod

    started = []

    class CountingThread(threading.Thread):
        def start(self):
            if self.name != "draft-restart":
                return super().start()
            started.append(self.name)  # not run: the test needs only how many restarts began

    monkeypatch.setattr(sup_mod.threading, "Thread", CountingThread)
    spec = sup_mod.WorkerSpec(runtime=RuntimeConfig(), draft=DraftConfig(), vocab_width=16)
    sup = sup_mod.DraftSupervisor(spec, launcher=SimpleNamespace())
    callers = 8
    entered = threading.Semaphore(0)
    everyone_in = threading.Event()

    class Proc:
        pid = 4242

        def poll(self):
            return 0

    class Chan:
        closed = False

        def close(self):
            everyone_in.wait(10)  # the reap is slow: every caller is inside fail() before the channel closes
            Chan.closed = True

    worker = sup_mod.Worker(proc=Proc(), channel=Chan(), generation=1)
    sup._worker = worker

    def die():
        entered.release()
        sup.fail(worker, "stopped answering")

    threads = [threading.Thread(target=die) for _ in range(callers)]
    for t in threads:
        t.start()
    for _ in range(callers):
        entered.acquire()
    everyone_in.set()
    for t in threads:
        t.join(30)
    assert sup.failures == 1 and started == ["draft-restart"] and sup._worker is None
