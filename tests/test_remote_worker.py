"""Draft workers on other hosts (runtime.worker: remote): a `hetero-spec draft-worker --connect` process that the
target did not start (it is not the target's child) drafts over loopback TCP with CURVE. Output equals the target
alone; a killed worker leaves the target decoding alone until a new one connects; a worker whose key the target
does not admit is refused and exits. Waits are bounded and only for events."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from hetero_spec import Engine
from hetero_spec.config import build_config
from hetero_spec.errors import ConfigError
from hetero_spec.transport.channel import key_fingerprint, write_keys
from tests.fixtures.waits import free_port, wait_for

PROMPTS = ["def read_lines(filename):", "import os\n", "class Stack:"]


def _detached_worker(port: int, keys: Path, model: Path, log: Path) -> int:
    """Start `hetero-spec draft-worker` through a shell that exits at once: the worker is nobody's child here."""
    cli = Path(sys.executable).with_name("hetero-spec")
    out = subprocess.run(["sh", "-c", f'"{cli}" draft-worker --connect tcp://127.0.0.1:{port} --keys "{keys}" '
                                      f'--model "{model}" >"{log}" 2>&1 & echo $!'],
                         capture_output=True, text=True, check=True, timeout=30)
    pid = int(out.stdout.strip())
    assert psutil.Process(pid).ppid() != os.getpid()
    return pid


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _cfg(target, draft, port, keys, **runtime):
    return {"target": {"model": str(target), "dtype": "float32", "device": "cpu"},
            "draft": {"kind": "onnx", "model": str(draft)}, "speculation": {"gamma": 4},
            "runtime": {"mode": "two_process", "worker": "remote", "transport": "tcp", "host": "127.0.0.1",
                        "port": port, "curve_keys": str(keys), "heartbeat_s": 0.5, "ready_timeout_s": 60,
                        "restart_backoff_s": 0.1, **runtime}}


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[Path, Path]:
    """The target's keys, and a worker's keys that the target does not admit (with the target's server.key)."""
    root = tmp_path_factory.mktemp("keys")
    good, wrong = write_keys(root / "good"), write_keys(root / "wrong")
    shutil.copy(good / "server.key", wrong / "server.key")
    return good, wrong


def test_a_remote_worker_drafts_is_replaced_and_a_wrong_key_is_refused(llama_target, llama_copy_onnx, keys,
                                                                        tmp_path, caplog):
    good, wrong = keys
    with Engine.from_config({"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu"},
                             "draft": {"kind": "none"}}) as alone:
        refs = [alone.generate(p, max_new_tokens=24, temperature=0.0).token_ids for p in PROMPTS]
    port = free_port()
    first = _detached_worker(port, good, llama_copy_onnx, tmp_path / "w1.log")
    pids = [first]
    try:
        with Engine.from_config(_cfg(llama_target, llama_copy_onnx, port, good)) as eng:
            outs = [eng.generate(p, max_new_tokens=24, temperature=0.0) for p in PROMPTS]
            assert [o.token_ids for o in outs] == refs
            assert sum(o.stats["drafted"] for o in outs) > 0  # the remote worker drafted
            assert eng.health()["draft"] == "ok"

            os.kill(first, signal.SIGKILL)
            wait_for(lambda: _gone(first), "the worker to die")
            # the target finishes alone, and notices the worker is gone
            for p, ref in zip(PROMPTS, refs):
                assert eng.generate(p, max_new_tokens=24, temperature=0.0).token_ids == ref
            wait_for(lambda: eng.health()["draft"] != "ok", "the target to notice the dead worker")

            refused = _detached_worker(port, wrong, llama_copy_onnx, tmp_path / "wrong.log")
            pids.append(refused)
            wait_for(lambda: _gone(refused), "the refused worker to exit")
            assert "refused this worker's CURVE key" in (tmp_path / "wrong.log").read_text()
            assert eng.health()["draft"] != "ok"

            # keys of another target altogether (its server.key too): the handshake itself fails; the worker says
            # so, naming the endpoint and its key's fingerprint, and exits 2; the target logs it too
            stranger = write_keys(tmp_path / "stranger")
            cli = Path(sys.executable).with_name("hetero-spec")
            with caplog.at_level("WARNING"):
                run = subprocess.run([str(cli), "draft-worker", "--connect", f"tcp://127.0.0.1:{port}", "--keys",
                                      str(stranger), "--model", str(llama_copy_onnx)], capture_output=True, text=True,
                                     timeout=120)
                wait_for(lambda: any("failed the CURVE handshake" in r.getMessage() for r in caplog.records),
                         "the target to log the failed handshake")
            import zmq.auth
            fingerprint = key_fingerprint(zmq.auth.load_certificate(str(stranger / "client.key"))[0])
            assert run.returncode == 2, run.stderr[-2000:]
            assert f"tcp://127.0.0.1:{port}" in run.stderr and fingerprint in run.stderr
            assert "the keys in --keys are not that target's" in run.stderr
            # the key the target's ZAP refused (the first wrong worker): logged with its fingerprint
            refused_print = key_fingerprint(zmq.auth.load_certificate(str(wrong / "client.key"))[0])
            assert any(refused_print in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)

            second = _detached_worker(port, good, llama_copy_onnx, tmp_path / "w2.log")
            pids.append(second)
            wait_for(lambda: eng.health()["draft"] == "ok", "the new worker to connect")
            outs = [eng.generate(p, max_new_tokens=24, temperature=0.0) for p in PROMPTS]
            assert [o.token_ids for o in outs] == refs
            assert sum(o.stats["drafted"] for o in outs) > 0
        # the target's Shutdown ends its session only: the worker waits for the next target
        assert not _gone(second)
    finally:
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGTERM)
        for pid in pids:
            wait_for(lambda: _gone(pid), f"worker {pid} to exit on SIGTERM", 30)


def test_remote_settings_are_checked(llama_target, llama_copy_onnx, keys, tmp_path):
    good, _ = keys
    bad = [({"mode": "in_process"}, "runtime.worker = 'remote': needs runtime.mode: two_process"),
           ({"transport": "ipc"}, "runtime.transport = 'ipc'"),
           ({"port": 0}, "runtime.port = 0"),
           ({"curve_keys": None}, "runtime.curve_keys = None"),
           ({"worker_keys": str(tmp_path)}, "runtime.worker_keys")]
    for extra, want in bad:
        cfg = _cfg(llama_target, llama_copy_onnx, 5555, good)
        cfg["runtime"].update(extra)
        with pytest.raises(ConfigError) as e:
            Engine.from_config(build_config(cfg))
        assert want in str(e.value), (extra, str(e.value))
