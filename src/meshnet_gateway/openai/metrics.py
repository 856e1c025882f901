"""Generation figures on the gateway's /metrics (the same registry as the rest).

Counts per outcome (``stop``, ``length``, ``error``, ``cancelled`` — the
client left), tokens in and out, and the two latencies users feel: the
prefill (prompt in, first token's logits back) and one decode step; and the
admission control's state (``meshnet_gateway.admission``): generations
admitted, requests queued, prompt tokens admitted and still prefilling,
refusals by reason, and how long admitted requests waited; and speculative
decoding's windows, drafted and accepted tokens (``SpeculationMetrics``).

``ServingMetrics``: the same story under the names a vLLM user's
dashboards and alerts query (``vllm:time_to_first_token_seconds`` →
``meshnet_time_to_first_token_seconds``, …; the table is in
docs/gateway.md, "Serving metrics"), labelled ``model_name`` as vLLM's are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from .output import GenerationResult
    from .timing import RequestTiming

__all__ = ["GenerationMetrics", "ServingMetrics", "SpeculationMetrics"]

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class GenerationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.generations = Counter(
            "meshnet_openai_generations",
            "Generations ended, by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=registry,
        )
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
            "meshnet_openai_prefill_seconds",
            "Prompt through the chain to the first logits",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.step_seconds = Histogram(
            "meshnet_openai_decode_step_seconds",
            "One generated token through the chain",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self._admission(registry)
        self.speculation = SpeculationMetrics(registry)

    def _admission(self, registry: CollectorRegistry) -> None:
        # Admission (docs/openai-api.md#admission): the gauges read the
        # Admission object itself (bound in OpenAIService), never a copy.
        self.admitted = Gauge(
            "meshnet_openai_admission_running",
            "Generations admitted and not yet ended (--max-running)",
            registry=registry,
        )
        self.queued = Gauge(
            "meshnet_openai_admission_queued",
            "Requests waiting for admission (--max-queued)",
            registry=registry,
        )
        self.prefill_tokens_admitted = Gauge(
            "meshnet_openai_admission_prefill_tokens",
            "Prompt tokens granted and on the chain now (--max-prefill-tokens)",
            registry=registry,
        )
        self.refused = Counter(
            "meshnet_openai_admission_refused",
            "Requests refused before any work: queue_full (429), queue_timeout (503)",
            ["reason"],
            registry=registry,
        )
        self.queue_wait_seconds = Histogram(
            "meshnet_openai_admission_wait_seconds",
            "Time queued requests waited, admitted or timed out",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )


class SpeculationMetrics:
    """Verify windows (wire-2 §3.16, ``speculation.py``): what was drafted,
    what the last stage accepted, and the rate, accepted / drafted tokens
    since the gateway started — the figure that says whether drafting pays
    (``drafts.DraftPolicy``'s cost model)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, text: str) -> Counter:
            return Counter(f"meshnet_openai_speculative_{name}", text, registry=registry)

        self.windows = counter("windows", "Verify windows answered and used")
        self.stale = counter(
            "stale_windows", "Verify windows sent whose answers were discarded (a rejection before)"
        )
        self.drafted_tokens = counter("drafted_tokens", "Tokens drafted in windows used")
        self.accepted_tokens = counter("accepted_tokens", "Drafted tokens the last stage accepted")
        self.fallbacks = counter(
            "fallbacks", "Generations gone on plainly: a window was answered with logits"
        )
        self._drafted = self._accepted = 0
        Gauge(
            "meshnet_openai_speculative_acceptance_rate",
            "Accepted / drafted tokens since start (0 before any window)",
            registry=registry,
        ).set_function(lambda: self._accepted / self._drafted if self._drafted else 0.0)

    def window(self, drafted: int, accepted: int) -> None:
        """A window used: ``drafted`` tokens sent, ``accepted`` of them kept."""
        self.windows.inc()
        self.drafted_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        self._drafted += drafted
        self._accepted += accepted


# vLLM's bucket edges (seconds), so that its dashboards' quantiles read the same.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def _token_buckets(context: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, … up to the context (vLLM's 1-2-5 series)."""
    edges: list[float] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > context:
                return tuple(edges)
            edges.append(float(step * scale))
        scale *= 10


class ServingMetrics:
    """vLLM's serving metrics with the ``meshnet_`` prefix, for one model.

    Every series carries ``model_name``. The histograms of one request
    (``observe_*``) are fed by ``OpenAIService`` from the request's
    ``RequestTiming``; the two gauges read the admission control live.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, context: int = 2048) -> None:
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, text, labels, buckets=buckets, registry=registry)

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, labels, registry=registry).labels(model_name)

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, labels, registry=registry).labels(model_name)

        self.running = gauge(
            "meshnet_num_requests_running",
            "Generations admitted and not yet ended (vllm:num_requests_running)",
        )
        self.waiting = gauge(
            "meshnet_num_requests_waiting",
            "Requests queued for admission (vllm:num_requests_waiting)",
        )
        self.prompt_tokens = counter(
            "meshnet_prompt_tokens", "Prompt tokens prefilled (vllm:prompt_tokens_total)"
        )
        self.generation_tokens = counter(
            "meshnet_generation_tokens",
            "Tokens generated, an eos included (vllm:generation_tokens_total)",
        )
        self._success = Counter(
            "meshnet_request_success",
            "Generations finished, by finished_reason (vllm:request_success_total)",
            [*labels, "finished_reason"],
            registry=registry,
        )
        self.ttft = histogram(
            "meshnet_time_to_first_token_seconds",
            "Arrival to the first token sampled, queue and prefill included",
            _TTFT_BUCKETS,
        ).labels(model_name)
        self.tpot = histogram(
            "meshnet_time_per_output_token_seconds",
            "Between two tokens of one generation (vllm:time_per_output_token_seconds)",
            _TPOT_BUCKETS,
        ).labels(model_name)
        self.itl = histogram(
            "meshnet_inter_token_latency_seconds",
            "Between two tokens of one generation (vLLM V1's name of the same)",
            _TPOT_BUCKETS,
        ).labels(model_name)
        self.e2e = histogram(
            "meshnet_e2e_request_latency_seconds",
            "Arrival to the last token of a finished generation",
            _REQUEST_BUCKETS,
        ).labels(model_name)
        self.queue_time = histogram(
            "meshnet_request_queue_time_seconds",
            "Time a generation waited for admission (0 when admitted at once)",
            _REQUEST_BUCKETS,
        ).labels(model_name)
        self.prefill_time = histogram(
            "meshnet_request_prefill_time_seconds",
            "Admission to the first token: the prompt through the chain",
            _REQUEST_BUCKETS,
        ).labels(model_name)
        self.decode_time = histogram(
            "meshnet_request_decode_time_seconds",
            "First token to last token of a finished generation",
            _REQUEST_BUCKETS,
        ).labels(model_name)
        tokens = _token_buckets(max(context, 1))
        self.request_prompt_tokens = histogram(
            "meshnet_request_prompt_tokens", "Prompt tokens of each finished generation", tokens
        ).labels(model_name)
        self.request_generation_tokens = histogram(
            "meshnet_request_generation_tokens",
            "Tokens generated by each finished generation",
            tokens,
        ).labels(model_name)

    def success(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def finished(self, timing: RequestTiming, result: GenerationResult, now: float) -> None:
        """A generation that finished (stop or length): its whole-request figures."""
        self.success(result.finish_reason)
        self.e2e.observe(now - timing.arrived)
        self.request_prompt_tokens.observe(result.prompt_tokens)
        self.request_generation_tokens.observe(result.completion_tokens)
        if timing.first_token is not None and timing.last_token is not None:
            self.decode_time.observe(timing.last_token - timing.first_token)
