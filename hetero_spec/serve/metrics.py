"""Prometheus metrics of `hetero-spec serve` (prometheus-client, one registry per app)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

STAGES = ("prefill", "draft", "verify", "wait", "total")


class ServeMetrics:
    """Requests, tokens, acceptance, per-stage times, batch sizes, speculation on/off, draft restarts and
    dropped frames. `observe(stats)` takes one finished request's stats (Engine stats dict)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("hetero_spec_requests", "Requests by endpoint and outcome",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("hetero_spec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("hetero_spec_completion_tokens", "Generated tokens", registry=r)
        self.drafted = Counter("hetero_spec_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted = Counter("hetero_spec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.acceptance = Histogram("hetero_spec_request_acceptance_rate", "Accepted / drafted per request",
                                    buckets=[i / 10 for i in range(11)], registry=r)
        self.stage = Histogram("hetero_spec_stage_seconds", "Per-request time in each stage", ["stage"],
                               buckets=[0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30], registry=r)
        self.batch = Histogram("hetero_spec_batch_size", "Requests decoded together, per round",
                               buckets=[1, 2, 4, 8, 16, 32, 64], registry=r)
        self.waiting = Gauge("hetero_spec_requests_waiting", "Requests queued for a place in the batch",
                             registry=r)
        self.in_flight = Gauge("hetero_spec_requests_in_flight", "Requests being served or queued", registry=r)
        self.speculation_on = Gauge("hetero_spec_speculation_on", "1 while the last request speculated at its end",
                                    registry=r)
        self.draft_restarts = Gauge("hetero_spec_draft_restarts", "Draft worker restarts over the server's life",
                                    registry=r)
        self.dropped = Counter("hetero_spec_dropped_frames", "Malformed or refused messages dropped", registry=r)
        self.cancelled = Counter("hetero_spec_cancelled_requests", "Requests ended by a client disconnect",
                                 registry=r)

    def observe(self, stats: dict[str, Any]) -> None:
        self.prompt_tokens.inc(stats.get("prompt_tokens", 0))
        self.completion_tokens.inc(stats.get("new_tokens", 0))
        drafted, accepted = stats.get("drafted", 0), stats.get("accepted", 0)
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        if drafted:
            self.acceptance.observe(accepted / drafted)
        for st in STAGES:
            v = stats.get(f"time_{st}_s")
            if v is not None:
                self.stage.labels(stage=st).observe(v)
        extra = stats.get("extra", {})
        self.speculation_on.set(1 if drafted > 0 else 0)
        self.dropped.inc(extra.get("dropped_messages", 0) + extra.get("rejected_messages", 0))

    def observe_batches(self, sizes: list[int]) -> None:
        """The batch size of each round since the last scrape (Engine.batch_sizes)."""
        for b in sizes:
            self.batch.observe(b)

    def render(self) -> bytes:
        return generate_latest(self.registry)
