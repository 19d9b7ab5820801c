"""Prometheus metrics of `hetero-spec serve` (prometheus-client, one registry per app)."""

from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

STAGES = ("prefill", "draft", "verify", "wait", "total")


class ServeMetrics:
    """Requests, tokens, acceptance, per-stage times, batch sizes, speculation on/off, draft restarts and
    dropped frames. `observe(stats)` takes one finished request's stats (Engine stats dict)."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        counter, gauge = partial(Counter, registry=registry), partial(Gauge, registry=registry)
        histogram = partial(Histogram, registry=registry)
        self.requests = counter("hetero_spec_requests", "HTTP responses by endpoint and status code (a stream by how "
                                "it ended: 200, 499 cancelled by the client, 500)", ["endpoint", "status"])
        self.prompt_tokens = counter("hetero_spec_prompt_tokens", "Prompt tokens of finished requests")
        self.completion_tokens = counter("hetero_spec_completion_tokens", "Generated tokens")
        self.drafted = counter("hetero_spec_draft_tokens", "Draft tokens verified")
        self.accepted = counter("hetero_spec_accepted_tokens", "Draft tokens accepted")
        self.acceptance = histogram("hetero_spec_request_acceptance_rate", "Accepted / drafted per request",
                                    buckets=[i / 10 for i in range(11)])
        self.stage = histogram("hetero_spec_stage_seconds", "Per-request time in each stage", ["stage"],
                               buckets=[0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30])
        self.batch = histogram("hetero_spec_batch_size", "Requests decoded together, per round",
                               buckets=[1, 2, 4, 8, 16, 32, 64])
        self.waiting = gauge("hetero_spec_requests_waiting", "Requests queued for a place in the batch")
        self.in_flight = gauge("hetero_spec_requests_in_flight", "Requests being served or queued")
        self.speculation_on = gauge("hetero_spec_speculation_on", "1 while the last request speculated at its end")
        self.draft_restarts = gauge("hetero_spec_draft_restarts", "Draft worker restarts over the server's life")
        self.dropped = counter("hetero_spec_dropped_frames", "Malformed or refused messages dropped")
        self.cancelled = counter("hetero_spec_cancelled_requests", "Requests ended by a client disconnect")

    def observe(self, stats: dict[str, Any]) -> None:
        self.prompt_tokens.inc(stats.get("prompt_tokens", 0))
        self.completion_tokens.inc(stats.get("new_tokens", 0))
        drafted, accepted = stats.get("drafted", 0), stats.get("accepted", 0)
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        if drafted:
            self.acceptance.observe(accepted / drafted)
        for stage in STAGES:
            if (seconds := stats.get(f"time_{stage}_s")) is not None:
                self.stage.labels(stage=stage).observe(seconds)
        extra = stats.get("extra", {})
        self.speculation_on.set(1 if drafted > 0 else 0)
        self.dropped.inc(extra.get("dropped_messages", 0) + extra.get("rejected_messages", 0))

    def scrape(self, engine) -> None:
        """Before a scrape: the batch size of each round since the last one (Engine.batch_sizes), the queue's length."""
        for size in engine.batch_sizes():
            self.batch.observe(size)
        self.waiting.set(engine.waiting_requests())

    def render(self) -> bytes:
        return generate_latest(self.registry)
