"""Generation figures on the gateway's /metrics (the same registry as the rest).

Counts per outcome (``stop``, ``length``, ``error``, ``cancelled`` — the
client left), tokens in and out, and the two latencies users feel: the
prefill (prompt in, first token's logits back) and one decode step; and the
admission control's state (``meshnet_gateway.admission``): generations
admitted, requests queued, prompt tokens admitted and still prefilling,
refusals by reason, and how long admitted requests waited.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["GenerationMetrics"]

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class GenerationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.generations = Counter(
            "meshnet_openai_generations", "Generations ended, by endpoint and outcome",
            ["endpoint", "outcome"], registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "meshnet_openai_prompt_tokens", "Prompt tokens sent down the chain", registry=registry
        )
        self.completion_tokens = Counter(
            "meshnet_openai_completion_tokens", "Tokens generated", registry=registry
        )
        self.active = Gauge(
            "meshnet_openai_active_generations", "Generations in progress", registry=registry
        )
        self.prefill_seconds = Histogram(
            "meshnet_openai_prefill_seconds", "Prompt through the chain to the first logits",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.step_seconds = Histogram(
            "meshnet_openai_decode_step_seconds", "One generated token through the chain",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        # Admission (docs/openai-api.md#admission): the gauges read the
        # Admission object itself (bound in OpenAIService), never a copy.
        self.admitted = Gauge(
            "meshnet_openai_admission_running",
            "Generations admitted and not yet ended (--max-running)", registry=registry,
        )  # fmt: skip
        self.queued = Gauge(
            "meshnet_openai_admission_queued",
            "Requests waiting for admission (--max-queued)", registry=registry,
        )  # fmt: skip
        self.prefill_tokens_admitted = Gauge(
            "meshnet_openai_admission_prefill_tokens",
            "Prompt tokens of admitted generations still prefilling (--max-prefill-tokens)",
            registry=registry,
        )  # fmt: skip
        self.refused = Counter(
            "meshnet_openai_admission_refused",
            "Requests refused before any work: queue_full (429), queue_timeout (503)",
            ["reason"], registry=registry,
        )  # fmt: skip
        self.queue_wait_seconds = Histogram(
            "meshnet_openai_admission_wait_seconds",
            "Time queued requests waited, admitted or timed out",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
