"""docs/edge.md's walk-through, its exact commands, on one machine: the server's side and the edge box's side in
folders of their own, the target served over HTTP by `hetero-spec serve`, the draft worker a separate
`hetero-spec draft-worker` process on loopback TCP with the keys `hetero-spec keys` made. Output equals the
target alone before the worker connects, while it drafts, after its link drops and after it is back. Waits are
bounded and only for events."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from hetero_spec import Engine
from tests.conftest import ROOT
from tests.fixtures.waits import free_port, wait_for

CLI = str(Path(sys.executable).with_name("hetero-spec"))


def _walkthrough() -> tuple[dict[str, list[str]], str]:
    """The doc's commands by their first words, and target.yaml."""
    text = (ROOT / "docs/edge.md").read_text()
    blocks = re.findall(r"```(\w+)\n(.*?)```", text, re.S)
    commands: dict[str, list[str]] = {}
    for lang, body in blocks:
        for line in body.splitlines():
            if lang == "bash" and line.strip():
                commands.setdefault(" ".join(line.split()[:2]), []).append(line.strip())
    (yaml,) = [body for lang, body in blocks if lang == "yaml"]
    return commands, yaml


def _local(text: str, http: int, link: int) -> str:
    """The doc's addresses, on loopback here."""
    return (text.replace("10.0.0.5:8000", f"127.0.0.1:{http}").replace("10.0.0.5:5555", f"127.0.0.1:{link}")
            .replace("--port 8000", f"--port {http}").replace("port: 5555", f"port: {link}")
            .replace("10.0.0.5", "127.0.0.1").replace("0.0.0.0", "127.0.0.1"))


def _run(line: str, cwd: Path, **popen) -> subprocess.Popen:
    argv = shlex.split(line)
    assert argv[0] == "hetero-spec", line
    return subprocess.Popen([CLI, *argv[1:]], cwd=cwd, **popen)


def _curl(line: str) -> httpx.Response:
    """A curl line of the doc, sent with httpx (its URL, header and body)."""
    argv = shlex.split(line.split("|")[0])
    url = "http://" + next(a for a in argv[1:] if not a.startswith("-") and argv[argv.index(a) - 1] not in
                           ("-H", "-d"))
    if "-d" in argv:
        return httpx.post(url, content=argv[argv.index("-d") + 1], headers={"Content-Type": "application/json"},
                          timeout=120)
    return httpx.get(url, timeout=120)


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def test_the_edge_walkthrough_runs_as_written(tmp_path, llama_target):
    commands, yaml_text = _walkthrough()
    http, link = free_port(), free_port()
    server, edge = tmp_path / "server", tmp_path / "edge"
    server.mkdir(), edge.mkdir()
    shutil.copytree(llama_target, server / "target")  # served as model "target", its folder's name
    (edge / "draft").symlink_to(llama_target)  # the draft: the target's own checkpoint, exported at int8
    procs: list[subprocess.Popen] = []
    try:
        # 1. keys on the server; the worker's half and the server's public key to the edge box (the doc's scp)
        (keys_cmd,) = commands["hetero-spec keys"]
        assert _run(keys_cmd, server).wait(60) == 0
        (copy,) = commands["ssh edge"]
        (edge / "keys").mkdir()
        for name in re.findall(r"keys/(\S+)", copy.split("&&")[1]):
            shutil.copy(server / "keys" / name, edge / "keys" / name)
        assert sorted(p.name for p in (edge / "keys").iterdir()) == ["client.key", "client.key_secret", "server.key"]
        # 2. the draft, exported on the edge box
        (export,) = commands["hetero-spec export"]
        assert _run(export, edge).wait(300) == 0
        # 3. the target, served; it answers alone until a worker is ready
        (server / "target.yaml").write_text(_local(yaml_text, http, link))
        (serve,) = commands["hetero-spec serve"]
        procs.append(_run(_local(serve, http, link), server, stdout=subprocess.DEVNULL,
                          stderr=open(tmp_path / "serve.log", "w")))
        health, completion, metrics = (_local(c, http, link) for c in commands["curl -s"])

        def answers() -> bool:
            assert procs[0].poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                return _curl(health).status_code in (200, 503)
            except httpx.TransportError:
                return False

        wait_for(answers, "the server to answer", 300)
        body = json.loads(shlex.split(completion)[-1])
        with Engine.from_config({"target": {"model": str(llama_target), "backend": "onnx"},
                                 "draft": {"kind": "none"}}) as alone:
            reference = alone.generate(body["prompt"], max_new_tokens=body["max_tokens"], temperature=0.0).text
        assert _curl(completion).json()["choices"][0]["text"] == reference
        # 4. the worker on the edge box connects; 5. it drafts, and /metrics shows it
        (worker_cmd,) = commands["hetero-spec draft-worker"]
        worker_log = tmp_path / "worker.log"
        worker = _run(_local(worker_cmd, http, link), edge, stdout=subprocess.DEVNULL, stderr=open(worker_log, "w"))
        procs.append(worker)
        wait_for(lambda: _curl(health).json().get("draft") == "ok", "the worker to be ready")
        assert _curl(health).status_code == 200
        # drafts verified: an event to wait for, since a proposal that misses its round's deadline is not waited for
        def drafted_over(before: float, metric: str = "hetero_spec_draft_tokens_total") -> bool:
            assert _curl(completion).json()["choices"][0]["text"] == reference  # one more request, as the target's
            return _metric(_curl(metrics).text, metric) > before

        # the first verified drafts may all miss (drafted ahead on a guess the target's token then broke): wait for
        # an accepted one, an event, rather than assert it of the first round that drafted
        wait_for(lambda: drafted_over(0, "hetero_spec_accepted_tokens_total"), "a draft token to be accepted")
        shown = _curl(metrics).text
        pattern = re.search(r"grep -E '(.*?)'", metrics).group(1)
        assert [line for line in shown.splitlines() if re.match(pattern, line)], "the doc's grep finds nothing"
        assert _metric(shown, "hetero_spec_draft_tokens_total") >= _metric(shown, "hetero_spec_accepted_tokens_total") > 0
        # 6. the link drops: the target answers alone, /health says so with a 503; the worker back, drafting again
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
        wait_for(lambda: _curl(health).json().get("draft") in ("dead", "unresponsive"), "the target to notice")
        assert _curl(health).status_code == 503
        assert _curl(completion).json()["choices"][0]["text"] == reference
        drafted = _metric(_curl(metrics).text, "hetero_spec_draft_tokens_total")
        procs.append(_run(_local(worker_cmd, http, link), edge, stdout=subprocess.DEVNULL,
                          stderr=open(worker_log, "a")))
        wait_for(lambda: _curl(health).json().get("draft") == "ok", "the worker to be back")
        wait_for(lambda: drafted_over(drafted), "drafts again")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
