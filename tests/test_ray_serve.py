"""`hetero-spec serve --ray`: two replicas of a tiny model pair on a local Ray instance (one per module), behind
the ingress `serve --ray` picks (HAProxy when its binary is there): greedy outputs equal one Engine's, both
replicas serve, a killed replica's requests fail cleanly while the others complete and Serve brings it back;
serving.ray's settings are validated. Waits are bounded and only for events; no wall-clock outcome is asserted."""

from __future__ import annotations

import builtins
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hetero_spec import Engine
from hetero_spec.config import build_config
from hetero_spec.errors import ConfigError, HeteroSpecError
from hetero_spec.serve import ray_serve
from hetero_spec.serve.ray_serve import REPLICA_HEADER, core_slice, deployment_options, mirror_metrics
from tests.fixtures.ray_streams import every_replica_serves, stream_to_done
from tests.fixtures.waits import free_port, wait_for

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

MODEL = "tiny"
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [f"def f{i}(x):" for i in range(16)]


def _cfg(target, draft, **ray_cfg):
    return {"target": {"model": str(target), "dtype": "float32", "device": "cpu", "threads": 1},
            "draft": {"kind": "onnx", "model": str(draft)}, "speculation": {"gamma": 4},
            "runtime": {"mode": "in_process", "heartbeat_s": 60},  # a paused round is not a stalled target
            "serving": {"max_batch": 8, "ray": {"num_replicas": 2, "cpus_per_replica": 1, **ray_cfg}}}


def _replica_pids() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if any("ServeReplica:hetero_spec" in part for part in (p.info["cmdline"] or []))]


def _haproxies() -> list[int]:
    return [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "haproxy"]


def _routed() -> int:
    """Replicas HAProxy sends requests to (UP in its stats, default port 8404); with Serve's proxy, the running ones."""
    if not _haproxies():
        return _running()
    rows = [line.split(",") for line in httpx.get("http://127.0.0.1:8404/stats;csv", timeout=10).text.splitlines()]
    return sum(1 for r in rows if len(r) > 17 and r[1].startswith("SERVE_REPLICA_") and r[17] == "UP")


def _running(app: str = "hetero_spec") -> int:
    st = serve.status().applications.get(app)
    if st is None or st.status != "RUNNING":
        return 0
    return sum(d.replica_states.get("RUNNING", 0) for d in st.deployments.values())


@pytest.fixture(scope="module")
def deployed(llama_target, llama_copy_onnx, tmp_path_factory):
    cfg = build_config(_cfg(llama_target, llama_copy_onnx))
    with Engine.from_config(cfg) as eng:
        refs = {p: eng.generate(p, max_new_tokens=24, temperature=0.0).text for p in PROMPTS}
    pause = tmp_path_factory.mktemp("ray") / "pause"
    env = pytest.MonkeyPatch()  # as `serve --ray` starts a local instance: HAProxy when found
    for key, value in ray_serve.local_env(cfg).items():
        env.setenv(key, value)
    metrics_port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,  # never another job's Ray
             _metrics_export_port=metrics_port, runtime_env={
        "env_vars": {"HETERO_SPEC_TEST_PAUSE_FILE": str(pause), "PYTHONPATH": str(ROOT)},
        "worker_process_setup_hook": "tests.fixtures.pause_target.setup"})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(ray_serve.application(cfg, MODEL), name="hetero_spec", route_prefix="/")
    wait_for(lambda: _running() == 2, "two running replicas", 180)
    wait_for(lambda: _routed() == 2, "the ingress to route to both", 120)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    yield client, refs, pause, metrics_port
    client.close()
    serve.shutdown()
    ray.shutdown()
    env.undo()
    wait_for(lambda: not _replica_pids(), "the replicas to exit", 60)
    wait_for(lambda: not _haproxies(), "HAProxy to exit", 60)


def _complete(client, prompt: str, max_tokens: int = 24) -> tuple[str, str]:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["text"], r.headers[REPLICA_HEADER]


def test_sixteen_concurrent_requests_equal_one_engine_and_both_replicas_serve(deployed):
    client, refs, pause, metrics_port = deployed
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]
    health = client.get("/health").json()  # the fixture waited for both replicas: every one is up
    assert health["status"] == "ok" and health["replicas"] == {"by_state": {"RUNNING": 2}, "all_ready": True}
    got = every_replica_serves(client, MODEL, PROMPTS, 24, pause)
    assert {p: text for p, (text, _) in got.items()} == refs
    assert len({replica for _, replica in got.values()}) == 2
    assert bool(_haproxies()) == ray_serve.haproxy_found()  # the ingress `auto` chose
    bad = client.post("/v1/completions", json={"model": "other", "prompt": "x"})
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"
    # Ray's metrics endpoint has the whole deployment: Serve's own metrics and ours, tagged per replica
    tokens: dict[str, float] = {}

    def scraped() -> bool:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        tokens.update({s.labels["replica"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                       if s.name == "ray_hetero_spec_completion_tokens_total"})
        # a replica's gauge can show its value from before these requests until its next mirror and export
        return len(tokens) == 2 and all(v > 0 for v in tokens.values()) and "ray_serve_" in text

    wait_for(scraped, "Ray's metrics endpoint to list both replicas' tokens", 120)
    assert set(tokens) == {replica for _, replica in got.values()}


def test_a_killed_replica_fails_its_requests_cleanly_and_comes_back(deployed):
    client, refs, pause, _ = deployed
    started: dict[str, str] = {}
    ended: set[str] = set()

    def stream(prompt: str) -> bool:
        done = stream_to_done(client, MODEL, prompt, 64, started)
        ended.add(prompt)
        return done

    prompts = PROMPTS[:8]
    before = set(_replica_pids())
    assert len(before) == 2
    pause.touch()  # every round waits: the streams are all mid-run when the kill comes
    with ThreadPoolExecutor(len(prompts)) as pool:
        futs = {p: pool.submit(stream, p) for p in prompts}
        wait_for(lambda: len(started) == len(prompts), "every stream to start", 120)
        assert len(set(started.values())) == 2 and not ended
        psutil.Process(sorted(before)[0]).kill()
        pause.unlink()
        ok = {p: f.result(timeout=300) for p, f in futs.items()}
    failed = {started[p] for p in prompts if not ok[p]}
    assert len(failed) == 1, f"exactly the killed replica's requests fail: {ok} {started}"
    survivors = [p for p in prompts if started[p] not in failed]
    assert survivors and all(ok[p] for p in survivors)
    wait_for(lambda: _running() == 2 and len(set(_replica_pids()) - before) == 1,
             "Serve to replace the killed replica", 180)
    wait_for(lambda: _routed() == 2, "the ingress to route to the new replica", 120)
    text, _ = _complete(client, PROMPTS[3])
    assert text == refs[PROMPTS[3]]


def test_serving_ray_settings_are_validated(llama_target, llama_copy_onnx):
    base = _cfg(llama_target, llama_copy_onnx)

    def cfg(max_waiting=256, **ray_cfg):
        return {**base, "serving": {"max_batch": 4, "max_waiting": max_waiting, "ray": ray_cfg}}

    bad = [({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "serving.ray.autoscaling"),
           ({"autoscaling": {"max_replicas": 0}}, "serving.ray.autoscaling.max_replicas"),
           ({"autoscaling": {"target_ongoing_requests": 0}}, "serving.ray.autoscaling.target_ongoing_requests"),
           ({"autoscaling": {}, "num_replicas": 2}, "serving.ray"),
           ({"num_replicas": 0}, "serving.ray.num_replicas"),
           ({"replicas": 2}, "serving.ray.replicas")]
    for extra, key in bad:
        with pytest.raises(ConfigError, match=r"serving\.ray\S* = ") as e:
            build_config(cfg(**extra))
        assert f"{key} = " in str(e.value), (extra, str(e.value))
    with pytest.raises(ConfigError, match=r"serving\.ray\.max_ongoing_requests = 6: must be at most .* \(5\)"):
        deployment_options(build_config(cfg(max_waiting=1, max_ongoing_requests=6)))
    opts = deployment_options(build_config(cfg(
        autoscaling={"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2})))
    assert opts["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2.0,
                                          "upscale_delay_s": 30.0, "downscale_delay_s": 600.0}  # Serve's defaults
    assert "num_replicas" not in opts and opts["max_ongoing_requests"] == 4
    assert opts["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0}  # target.threads 1, in process
    two = build_config({**cfg(num_replicas=2), "runtime": {"mode": "two_process"}})
    assert deployment_options(two)["ray_actor_options"]["num_cpus"] == 2.0  # plus the worker's thread
    assert deployment_options(two)["num_replicas"] == 2


def test_replicas_that_do_not_fit_the_machine_are_an_error_before_ray_starts(llama_target, llama_copy_onnx,
                                                                           monkeypatch):
    """Two replicas of 2 CPUs on a 2-core machine: Ray would start one and keep the other pending for good (every
    request then went to one replica). A clear error names the key, the CPUs and the fix, before Ray starts."""
    two = build_config({**_cfg(llama_target, llama_copy_onnx, cpus_per_replica=None),
                        "runtime": {"mode": "two_process"}}, source="r.yaml")
    with pytest.raises(ConfigError) as e:
        ray_serve.check_fits(two, 2)
    assert (e.value.source, e.value.key_path, e.value.value) == ("r.yaml", "serving.ray.num_replicas", 2)
    assert e.value.problem.startswith("2 replicas of 2 CPUs each (target.threads 1 + draft.threads 1, the "
                                      "two_process layout) need 4, and this machine has 2")
    assert "set serving.ray.cpus_per_replica: 1" in e.value.problem
    ray_serve.check_fits(two, 4)  # fits
    ray_serve.check_fits(build_config(_cfg(llama_target, llama_copy_onnx)), 2)  # 2 x cpus_per_replica 1
    scaling = build_config({**_cfg(llama_target, llama_copy_onnx), "serving": {"ray": {
        "cpus_per_replica": 1, "autoscaling": {"min_replicas": 1, "max_replicas": 3}}}})
    with pytest.raises(ConfigError, match=r"serving\.ray\.autoscaling\.max_replicas = 3: 3 replicas of 1 CPUs"):
        ray_serve.check_fits(scaling, 2)
    monkeypatch.setattr(ray_serve, "_ray", lambda: pytest.fail("Ray was started before the check"))
    monkeypatch.setattr("hetero_spec.runtime.cpus.allowed", lambda: [0, 1])
    with pytest.raises(ConfigError, match="serving.ray.num_replicas"):
        ray_serve.serve_ray(two)


def test_the_ingress_is_haproxy_when_found_and_a_missing_binary_is_named(llama_target, llama_copy_onnx,
                                                                         monkeypatch):
    def env(ingress: str, found: bool) -> dict:
        monkeypatch.setattr(ray_serve, "haproxy_found", lambda: found)
        return ray_serve.local_env(build_config(_cfg(llama_target, llama_copy_onnx, ingress=ingress)))

    assert env("auto", True)["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env("haproxy", True)["RAY_SERVE_HAPROXY_NBTHREAD"] == "1"
    for ingress, found in (("auto", False), ("proxy", True)):
        assert "RAY_SERVE_ENABLE_HA_PROXY" not in env(ingress, found), ingress
    assert env("proxy", True)["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "60"  # Serve's 5 s fails a slow start
    assert env("proxy", True)["RAY_worker_niceness"] == "0"  # at Ray's 15 a busy machine starves the replicas
    with pytest.raises(ConfigError, match=r"serving\.ray\.ingress = 'haproxy': no HAProxy binary: pip install"):
        env("haproxy", False)
    with pytest.raises(ConfigError, match=r"serving\.ray\.ingress = 'nginx'"):
        build_config(_cfg(llama_target, llama_copy_onnx, ingress="nginx"))
    monkeypatch.undo()
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/opt/haproxy")
    assert ray_serve.haproxy_found()


def test_health_says_whether_every_replica_is_up():
    """replica_report reads serve.status(): all_ready only when every deployment is HEALTHY (it has the replicas
    Serve wants) and they all run; one still starting, or an upscale under way, is not ready."""
    from types import SimpleNamespace as NS

    def status(deployment_status, **states):
        deployment = NS(status=deployment_status, replica_states=states)
        return NS(applications={"app": NS(deployments={"hetero_spec": deployment})})

    assert ray_serve.replica_report(status("HEALTHY", RUNNING=2), "app") == {"by_state": {"RUNNING": 2},
                                                                               "all_ready": True}
    assert not ray_serve.replica_report(status("UPDATING", RUNNING=1, STARTING=1), "app")["all_ready"]
    assert not ray_serve.replica_report(status("UPSCALING", RUNNING=1), "app")["all_ready"]
    assert not ray_serve.replica_report(status("HEALTHY", RUNNING=2), "other app")["all_ready"]


def test_replicas_get_disjoint_cores():
    cores = list(range(8))
    slices = [core_slice(cores, 2, r) for r in range(4)]
    assert slices == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert core_slice(cores, 2, 4) is None  # no slice of its own: it shares, unpinned
    assert core_slice([0, 1], 2, 0) is None  # one replica's worth of cores: nothing to separate


def test_our_metrics_mirror_into_ray_with_the_replica_tag():
    from prometheus_client import CollectorRegistry, Counter

    reg = CollectorRegistry()
    Counter("hetero_spec_requests", "r", ["endpoint"], registry=reg).labels(endpoint="chat").inc(3)
    seen = {}

    class Gauge:
        def __init__(self, name):
            self.name = name

        def set(self, value, tags):
            seen[self.name] = (value, tags)

    n = mirror_metrics(reg, lambda name, keys: Gauge(name), {"replica": "r1"})
    assert n == 2  # the counter's total and its created timestamp
    assert seen["hetero_spec_requests_total"] == (3.0, {"endpoint": "chat", "replica": "r1"})


def test_ray_missing_names_the_extra(monkeypatch):
    real = builtins.__import__

    def no_ray(name, *a, **k):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(HeteroSpecError, match=r"hetero-spec\[ray\]"):
        ray_serve._ray()


def test_the_health_check_fails_on_a_stalled_target_or_a_worker_that_stays_dead(monkeypatch):
    import asyncio

    now = [100.0]
    monkeypatch.setattr(ray_serve.time, "monotonic", lambda: now[0])

    class FakeEngine:
        config = build_config({})
        answer = {"target": "ok", "draft": "ok"}

        def health(self, timeout_s):
            return self.answer

    rep = ray_serve.Replica.__new__(ray_serve.Replica)
    rep.engine, rep._unwell_since = FakeEngine(), None
    check = lambda: asyncio.run(rep.check_health())  # noqa: E731
    check()
    rep.engine.answer = {"target": "ok", "draft": "restarting"}
    check()  # a restart is under way: not yet a reason to replace the replica
    now[0] += ray_serve.RESTART_GRACE_S + 1
    with pytest.raises(RuntimeError, match="draft worker restarting"):
        check()
    rep.engine.answer = {"target": "ok", "draft": "ok"}
    check()  # it came back: healthy, and the clock starts over
    assert rep._unwell_since is None
    rep.engine.answer = {"target": "stalled", "draft": "ok"}
    with pytest.raises(RuntimeError, match="target stalled"):
        check()


def test_serve_ray_starts_a_local_instance_with_its_settings_and_drains_on_sigterm(
        llama_target, llama_copy_onnx, monkeypatch):
    calls: list = []

    class FakeRay:
        def init(self, **kw):
            calls.append(("init", kw, dict(os.environ)))

        def shutdown(self):
            calls.append(("ray.shutdown",))

    class FakeServe:
        def start(self, **kw):
            calls.append(("start", kw))

        def run(self, app, **kw):
            calls.append(("run", kw["name"]))
            signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # as Ray's own handlers do

        def shutdown(self):
            calls.append(("serve.shutdown",))

    monkeypatch.setattr(ray_serve, "_ray", lambda: (FakeRay(), FakeServe()))
    monkeypatch.setattr(ray_serve, "application", lambda config, name: "app")
    monkeypatch.setattr(os, "environ", {**os.environ, "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "5"})  # the user's
    monkeypatch.setattr(ray_serve.time, "sleep", lambda s: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.getsignal(signal.SIGTERM)
    try:
        cfg = build_config(_cfg(llama_target, llama_copy_onnx, metrics_export_port=9400))
        assert ray_serve.serve_ray(cfg, port=8123) == 0
    finally:
        signal.signal(signal.SIGTERM, before)
    (_, init, env), *rest = calls
    assert init["address"] is None and init["_metrics_export_port"] == 9400
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1" and env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "5"
    assert rest == [("start", {"proxy_location": "EveryNode", "http_options": {"host": "127.0.0.1", "port": 8123}}),
                    ("run", "hetero_spec"),
                    ("serve.shutdown",), ("ray.shutdown",)]  # SIGTERM: the same drain as Ctrl-C


def test_serve_ray_goes_on_when_serve_s_proxies_start_late(llama_target, llama_copy_onnx, monkeypatch):
    """serve.start gives up on its HTTP proxies after a fixed 60 s (a loaded node): the controller it started is
    kept (a second start connects to it) and the application is deployed all the same."""
    calls: list = []

    class FakeRay:
        def init(self, **kw):
            calls.append("init")

        def shutdown(self):
            calls.append("ray.shutdown")

    class FakeServe:
        def start(self, **kw):
            calls.append("start")
            if calls.count("start") == 1:
                raise TimeoutError("HTTP proxies not available after 60s.")

        def run(self, app, **kw):
            calls.append("run")

        def shutdown(self):
            calls.append("serve.shutdown")

    monkeypatch.setattr(ray_serve, "_ray", lambda: (FakeRay(), FakeServe()))
    monkeypatch.setattr(ray_serve, "application", lambda config, name: "app")
    monkeypatch.setattr(ray_serve.time, "sleep", lambda s: (_ for _ in ()).throw(KeyboardInterrupt))
    assert ray_serve.serve_ray(build_config(_cfg(llama_target, llama_copy_onnx)), port=8124) == 0
    assert calls == ["init", "start", "start", "run", "serve.shutdown", "ray.shutdown"]
