"""Prometheus metrics of `hetero-spec serve` (prometheus-client, one registry per app)."""

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..metrics import Stats

STAGES = ("prefill", "draft", "verify", "wait", "total")


class ServeMetrics:
    """Requests, tokens, acceptance, per-stage times, batch sizes, speculation on/off, draft restarts and
    dropped frames. `observe(stats)` takes one finished request's Stats."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        counter, gauge, histogram = (partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram))
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

    def observe(self, stats: Stats) -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.completion_tokens.inc(stats.new_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        if (rate := stats.acceptance_rate) is not None:  # None: nothing drafted
            self.acceptance.observe(rate)
        for stage in STAGES:
            self.stage.labels(stage=stage).observe(getattr(stats, f"time_{stage}_s"))
        self.speculation_on.set(1 if stats.drafted > 0 else 0)
        self.dropped.inc(stats.extra.get("dropped_messages", 0) + stats.extra.get("rejected_messages", 0))

    def scrape(self, engine) -> None:
        """Before a scrape: the batch size of each round since the last one (Engine.batch_sizes), the queue's length."""
        for size in engine.batch_sizes():
            self.batch.observe(size)
        self.waiting.set(engine.waiting_requests())

    def render(self) -> bytes:
        return generate_latest(self.registry)
