"""serving.ray.autoscaling under a load ramp, on a local Ray instance behind the ingress `serve --ray` picks: with
min_replicas 1 and max_replicas 2, a load of 1 then 16 concurrent streams makes Serve add the second replica, and
when the load falls back to one stream, then none, Serve removes it; every output equals one Engine's, none is
lost. The replica count over time is printed (run with -s). Each round of a replica waits while a pause file
exists, so the load is held for as long as the test needs, not for a length of time; waits are bounded and only
for events."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from hetero_spec import Engine
from hetero_spec.config import build_config
from hetero_spec.serve import ray_serve
from tests.fixtures.waits import free_port, wait_for

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

MODEL = "tiny"
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [f"def h{i}(x):" for i in range(16)]


def _running() -> int:
    st = serve.status().applications.get("hetero_spec")
    return 0 if st is None else sum(d.replica_states.get("RUNNING", 0) for d in st.deployments.values())


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(llama_target, llama_copy_onnx, tmp_path):
    raw = {"target": {"model": str(llama_target), "dtype": "float32", "device": "cpu", "threads": 1},
           "draft": {"kind": "onnx", "model": str(llama_copy_onnx)}, "speculation": {"gamma": 4},
           "runtime": {"mode": "in_process", "heartbeat_s": 60},
           "serving": {"max_batch": 8, "ray": {"cpus_per_replica": 1, "autoscaling": {
               "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
               "upscale_delay_s": 1, "downscale_delay_s": 5}}}}
    cfg = build_config(raw)
    with Engine.from_config(cfg) as eng:
        refs = {p: eng.generate(p, max_new_tokens=24, temperature=0.0).text for p in PROMPTS}
    pause = tmp_path / "pause"
    env = pytest.MonkeyPatch()
    for key, value in ray_serve.local_env(cfg).items():
        env.setenv(key, value)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={
        "env_vars": {"HETERO_SPEC_TEST_PAUSE_FILE": str(pause), "PYTHONPATH": str(ROOT)},
        "worker_process_setup_hook": "tests.fixtures.pause_target.setup"})
    timeline: list[tuple[float, str, int]] = []
    start = time.monotonic()

    def note(what: str) -> None:
        timeline.append((round(time.monotonic() - start, 1), what, _running()))

    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_serve.application(cfg, MODEL), name="hetero_spec", route_prefix="/")
        wait_for(lambda: _running() == 1, "the first replica", 180)
        note("deployed")
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)

        def complete(prompt: str) -> str:
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 24,
                                                     "temperature": 0})
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        assert complete(PROMPTS[0]) == refs[PROMPTS[0]]  # one stream: one replica is enough
        assert _running() == 1
        note("1 stream")
        pause.touch()  # 16 streams held in flight: 8 per replica's batch, the rest queued
        with ThreadPoolExecutor(16) as pool:
            burst = [pool.submit(complete, p) for p in PROMPTS]
            note("16 streams")
            wait_for(lambda: _running() == 2, "Serve to add the second replica", 300)
            note("16 streams")
            pause.unlink()
            outs = [f.result(timeout=300) for f in burst]
        assert outs == [refs[p] for p in PROMPTS]  # none lost, none changed
        note("burst done")
        # back to one stream at a time, then none: Serve removes the second replica; nothing is lost meanwhile
        served = 0
        while _running() > 1:
            prompt = PROMPTS[served % len(PROMPTS)]
            assert complete(prompt) == refs[prompt]
            served += 1
            if served == 1:
                note("1 stream")
            if served > 2000:
                raise AssertionError("Serve kept two replicas for 2000 sequential requests")
        note(f"after {served} sequential requests")
        wait_for(lambda: _running() == 1, "one replica", 120)
        assert complete(PROMPTS[1]) == refs[PROMPTS[1]]
        note("idle")
        client.close()
    finally:
        if pause.exists():
            pause.unlink()
        print("\nreplicas over time (s, load, running replicas):")
        for row in timeline:
            print("  ", *row)
        serve.shutdown()
        ray.shutdown()
        env.undo()
    counts = [n for _, _, n in timeline]
    assert counts[0] == 1 and 2 in counts and counts[-1] == 1
