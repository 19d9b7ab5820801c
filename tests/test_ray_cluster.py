"""`hetero-spec serve --ray --address ...` on a Ray cluster of two nodes, both on this machine (Ray's own
`cluster_utils.Cluster`, on loopback): one replica on each node (serving.ray.max_replicas_per_node 1), both serve;
a node lost while requests run fails only its replica's requests, and Serve brings the replica back when a node
returns. The test starts and stops the nodes and the server itself and leaves no process. Waits are bounded and
only for events; no wall-clock outcome is asserted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from hetero_spec import Engine
from hetero_spec.config import build_config
from hetero_spec.serve.ray_serve import REPLICA_HEADER
from tests.fixtures.ray_streams import every_replica_serves, stream_to_done
from tests.fixtures.waits import free_port, wait_for

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

MODEL = "tiny"
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [f"def g{i}(x):" for i in range(16)]


def _config(target: Path, draft: Path) -> dict:
    return {"target": {"model": str(target), "dtype": "float32", "device": "cpu", "threads": 1},
            "draft": {"kind": "onnx", "model": str(draft)}, "speculation": {"gamma": 4},
            "runtime": {"mode": "in_process", "heartbeat_s": 60},
            "serving": {"max_batch": 8, "ray": {"num_replicas": 2, "cpus_per_replica": 1, "max_replicas_per_node": 1,
                                                "proxy_location": "HeadOnly"}}}


def _health(client: httpx.Client) -> dict:
    try:
        return client.get("/health").json()
    except (httpx.HTTPError, ValueError):
        return {}


def _ours_left(session_dir: str) -> list[int]:
    """Processes of this cluster (its session directory on their command line) or of our replicas."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if session_dir in line or "ServeReplica:hetero_spec" in line:
            found.append(proc.pid)
    return found


def _lose(cluster, node) -> None:
    """The node is gone, as a machine that fails is: its raylet and every process under it (the replica) killed
    at once, then taken out of the cluster."""
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    for proc in [raylet, *raylet.children(recursive=True)]:
        proc.kill()
    cluster.remove_node(node, allow_graceful=False)


def test_two_nodes_serve_one_replica_each_and_a_lost_node_comes_back(llama_target, llama_copy_onnx, tmp_path,
                                                                     monkeypatch):
    raw = _config(llama_target, llama_copy_onnx)
    (config_file := tmp_path / "cluster.yaml").write_text(yaml.safe_dump(raw))
    with Engine.from_config(build_config(raw)) as eng:
        refs = {p: eng.generate(p, max_new_tokens=24, temperature=0.0).text for p in PROMPTS}
    pause = tmp_path / "pause"
    # the nodes start as docs/scale-out.md says (Serve reads it in the cluster's own processes): with Serve's 5 s
    # default ready check, a proxy starting on a loaded 1-CPU node is killed and `serve` fails
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    second = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    session_dir = cluster.head_node.get_session_dir_path()
    port = free_port()
    # the runtime env `ray job submit` would give the driver: the pause hook in every worker of the job
    job = {"runtime_env": {"env_vars": {"HETERO_SPEC_TEST_PAUSE_FILE": str(pause), "PYTHONPATH": str(ROOT)},
                           "worker_process_setup_hook": "tests.fixtures.pause_target.setup"}}
    env = {**os.environ, "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job)}
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([str(Path(sys.executable).parent / "hetero-spec"), "serve", "--ray",
                               "--address", cluster.address, "--config", str(config_file), "--port", str(port),
                               "--model-name", MODEL],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    try:
        def all_ready() -> bool:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            return _health(client).get("replicas", {}).get("all_ready") is True

        try:
            # under CI-like load (two busy loops beside the suite) a replica took 166 s to be scheduled and
            # initialized, and the other had initialized but not passed its first health check 140 s later
            wait_for(all_ready, "both replicas running, one on each node", 480)
        except AssertionError as exc:  # say where it stood: the replicas' states and the server's last words
            raise AssertionError(f"{exc}; /health: {_health(client)}; serve.log: "
                                 f"{(tmp_path / 'serve.log').read_text()[-3000:]}") from None
        assert _health(client)["replicas"]["by_state"] == {"RUNNING": 2}

        def complete(prompt: str) -> tuple[str, str]:
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 24,
                                                     "temperature": 0})
            r.raise_for_status()
            return r.json()["choices"][0]["text"], r.headers[REPLICA_HEADER]

        # 16 at once, two replicas of 8 each: both nodes' replicas serve
        got = every_replica_serves(client, MODEL, PROMPTS, 24, pause)
        assert {p: text for p, (text, _) in got.items()} == refs
        assert len({replica for _, replica in got.values()}) == 2

        # the second node is lost while every stream is mid-run (each round waits on the pause file)
        started: dict[str, str] = {}

        def stream(prompt: str) -> bool:
            return stream_to_done(client, MODEL, prompt, 48, started)

        prompts = PROMPTS  # more than one replica takes at once (max_ongoing_requests 8): both get some
        pause.touch()
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = {p: pool.submit(stream, p) for p in prompts}
            wait_for(lambda: len(started) == len(prompts), "every stream to start", 120)
            assert len(set(started.values())) == 2
            _lose(cluster, second)
            pause.unlink()
            ok = {p: f.result(timeout=300) for p, f in futures.items()}
        failed = {started[p] for p in prompts if not ok[p]}
        assert len(failed) == 1, f"exactly the lost node's replica's requests fail: {ok} {started}"
        assert all(ok[p] for p in prompts if started[p] not in failed)
        wait_for(lambda: _health(client).get("replicas", {}).get("all_ready") is False,
                 "/health to say a replica is missing", 180)
        assert complete(PROMPTS[5])[0] == refs[PROMPTS[5]]  # the head's replica serves meanwhile

        cluster.add_node(num_cpus=1)  # the node returns: Serve places the missing replica there
        wait_for(all_ready, "Serve to bring the replica back", 300)
        again = every_replica_serves(client, MODEL, PROMPTS, 24, pause)
        assert {p: text for p, (text, _) in again.items()} == refs
        assert len({r for _, r in again.values()}) == 2 and failed.isdisjoint(r for _, r in again.values())
    finally:
        client.close()
        if pause.exists():
            pause.unlink()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=120)
        finally:
            if server.poll() is None:
                server.kill()
            log.close()
            cluster.shutdown()
    wait_for(lambda: not _ours_left(session_dir), "every process of the cluster to exit", 120)
    assert server.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
