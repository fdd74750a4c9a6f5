"""Prometheus metrics of the target, named so vLLM dashboards translate (`vllm:` → `splitspec_`).

Everything observed here is a host-side Python number the engine already has (token
counts, monotonic timestamps): recording a metric never synchronizes the GPU. Gauges of
the engine's state (running, waiting, KV pages, drafter up) are read at scrape time by a
collector, so the hot path pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector

from common.kv_layout import KVLayout
from target_service.sequence import Sequence

# Buckets as vLLM's, so percentiles compare.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
NUM_DRAFTS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
PROPOSE_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048)


@dataclass(frozen=True)
class EngineState:
    """The engine at a glance: what the gauges and GetServerInfo report."""

    running: int
    waiting: int
    num_pages: int
    free_pages: int
    layout: KVLayout
    drafter: dict  # DrafterLink.describe(): state, address, kind, K, epoch, detail
    prefix_cache: dict = field(default_factory=dict)  # PageManager.describe_cache()

    @property
    def usage(self) -> float:
        return 1.0 - self.free_pages / self.num_pages

    @property
    def drafter_up(self) -> bool:
        return self.drafter.get("state") == "ready"


class TargetMetrics:
    """The target's metric families in their own registry (no module-level state)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests_finished = Counter("splitspec_requests_finished", "Finished requests by finish reason.",
                                         ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("splitspec_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("splitspec_generation_tokens", "Generated (emitted) tokens.", registry=r)
        self.prefix_cache_queries = Counter(
            "splitspec_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at admission (vLLM's prefix_cache_queries).", registry=r)
        self.prefix_cache_hits = Counter(
            "splitspec_prefix_cache_hits",
            "Of those, tokens whose KV was found cached and reused (vLLM's prefix_cache_hits).", registry=r)
        self.preemptions = Counter("splitspec_preemptions", "Sequences preempted for recompute.", registry=r)
        self.ttft = Histogram("splitspec_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("splitspec_inter_token_latency_seconds",
                             "Time between tokens; a step emitting n tokens counts n observations of interval/n.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("splitspec_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("splitspec_request_queue_time_seconds", "Time from arrival to first scheduling.",
                                    buckets=REQUEST_BUCKETS, registry=r)
        self.num_drafts = Counter("splitspec_spec_decode_num_drafts", "Verify steps that carried draft tokens.",
                                  registry=r)
        self.num_draft_tokens = Counter("splitspec_spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                        registry=r)
        self.num_accepted_tokens = Counter("splitspec_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                           registry=r)
        self.accepted_per_pos = Counter("splitspec_spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the draft (0-based).", ["position"],
                                        registry=r)
        self.handshakes = Counter("splitspec_drafter_handshakes", "Handshakes with the drafter by result.",
                                  ["result"], registry=r)
        self.fallback_steps = Counter("splitspec_spec_decode_fallback_steps",
                                      "Steps run without speculation because the drafter was unavailable or failed.",
                                      registry=r)
        self.batch_disabled_steps = Counter(
            "splitspec_spec_decode_batch_disabled_steps",
            "Steps run without drafts because the batch reached --speculative-disable-by-batch-size.", registry=r)
        # the policy decides every step: counted in plain integers, exported at scrape time as
        # splitspec_spec_decode_num_drafts_chosen, _policy_zero_draft_steps and _policy_probes
        self.draft_decisions = DraftDecisionCounts()
        r.register(self.draft_decisions)
        self.invalid_drafts = Counter("splitspec_spec_decode_invalid_drafts",
                                      "Drafts discarded as invalid (unknown sequence, out-of-vocabulary ids, too long).",
                                      registry=r)
        self.propose_latency = Histogram("splitspec_drafter_propose_latency_seconds",
                                         "Round trip of one batched Propose.", buckets=PROPOSE_BUCKETS, registry=r)
        self.forward_duration = Histogram(
            "splitspec_model_forward_duration_seconds",
            "One step's forward (with sampling and acceptance), by kind: verify (drafts were checked), "
            "prefill (a prompt chunk ran, no drafts), decode (one new token per sequence).",
            ["kind"], buckets=PROPOSE_BUCKETS, registry=r)
        self._forward_by_kind = {kind: self.forward_duration.labels(kind) for kind in ("verify", "prefill", "decode")}

    def observe_forward(self, seconds: float, verified: bool, prefilled: bool) -> None:
        kind = "verify" if verified else "prefill" if prefilled else "decode"
        self._forward_by_kind[kind].observe(seconds)  # labels() per step costs a lock and a lookup

    def watch(self, state: Callable[[], EngineState]) -> None:
        """Expose the engine's state as gauges read at scrape time."""
        self.registry.register(EngineStateCollector(state))

    # -- per-request events (host values only) ---------------------------------------

    def on_admitted(self, seq: Sequence) -> None:
        self.prompt_tokens.inc(seq.num_prompt_tokens)

    def on_prefix_query(self, num_tokens: int, num_hit: int) -> None:
        self.prefix_cache_queries.inc(num_tokens)
        self.prefix_cache_hits.inc(num_hit)

    def on_scheduled(self, seq: Sequence, now: float) -> None:
        self.queue_time.observe(now - seq.arrival_time)

    def on_tokens(self, seq: Sequence, n: int, now: float, first: bool, previous: float | None) -> None:
        self.generation_tokens.inc(n)
        if first:
            self.ttft.observe(now - seq.arrival_time)
            n -= 1  # the first token has no interval before it
        if previous is not None and n > 0:
            interval = (now - previous) / n
            for _ in range(n):
                self.itl.observe(interval)

    def on_finished(self, seq: Sequence, reason: str, now: float) -> None:
        self.requests_finished.labels(finish_reason=reason).inc()
        self.e2e.observe(now - seq.arrival_time)

    def on_verified(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts.inc()
        self.num_draft_tokens.inc(num_draft)
        self.num_accepted_tokens.inc(num_accepted)
        for position in range(num_accepted):
            self.accepted_per_pos.labels(position=str(position)).inc()


class DraftDecisionCounts(Collector):
    """The speculative policy's decisions: one per step with decoding sequences the drafter
    follows, and one per step with nobody to decide for while no drafts pay (k = 0). Counted in
    plain integers and exported when Prometheus scrapes, as a histogram of the drafts chosen and
    counters of the steps that asked none and of the probes: a `Histogram.observe` and a
    `Counter.inc` (locks, bucket search) cost 8-10 µs inside a 2 ms step on a 2-core EPYC, whose
    caches the forward has just filled, which was a third of what an idle split adds to a step."""

    HISTOGRAM = "splitspec_spec_decode_num_drafts_chosen"
    ZERO_STEPS = "splitspec_spec_decode_policy_zero_draft_steps"
    PROBES = "splitspec_spec_decode_policy_probes"

    def __init__(self) -> None:
        self._by_k: dict[int, int] = {}
        self.zero_steps = 0
        self.probes = 0

    def record(self, k: int, probe: bool = False) -> None:
        """A decision: `k` drafts for the batch, and `probe` when one sequence was asked for more."""
        self._by_k[k] = self._by_k.get(k, 0) + 1
        if probe:
            self.probes += 1
        elif k == 0:
            self.zero_steps += 1

    def collect(self):
        by_k = dict(self._by_k)  # a snapshot: the engine thread counts on meanwhile
        buckets = [(str(float(bound)), sum(count for k, count in by_k.items() if k <= bound))
                   for bound in NUM_DRAFTS_BUCKETS]  # cumulative, as Prometheus' `le`
        buckets.append(("+Inf", sum(by_k.values())))
        yield HistogramMetricFamily(
            self.HISTOGRAM,
            "Drafts per sequence the speculative policy asked for, one observation per step with decoding "
            "sequences the drafter follows (fixed policy: always K), and a k = 0 for each step with none "
            "followed while no drafts pay; a probe's one sequence is counted in "
            "splitspec_spec_decode_policy_probes.",
            buckets=buckets, sum_value=sum(k * count for k, count in by_k.items()))
        yield CounterMetricFamily(
            self.ZERO_STEPS,
            "Steps where the speculative policy asked for no drafts (they were not expected to pay) and probed "
            "nothing, steps with no sequence followed while no drafts pay included.", value=self.zero_steps)
        yield CounterMetricFamily(
            self.PROBES,
            "Steps where the speculative policy asked one sequence for more drafts than the batch, to learn "
            "the acceptance of positions it is unsure of.", value=self.probes)


class EngineStateCollector(Collector):
    """Gauges computed when Prometheus scrapes: running/waiting, KV pool, drafter, layout."""

    def __init__(self, state: Callable[[], EngineState]) -> None:
        self._state = state

    def collect(self):
        state = self._state()
        yield _gauge("splitspec_requests_running", "Sequences in the running batch.", state.running)
        yield _gauge("splitspec_requests_waiting", "Requests waiting for admission.", state.waiting)
        yield _gauge("splitspec_kv_cache_usage_ratio", "Fraction of KV pages in use (0..1).", state.usage)
        yield _gauge("splitspec_kv_cache_free_pages", "Free KV pages.", state.free_pages)
        yield _gauge("splitspec_kv_cache_pages", "KV pages in the pool.", state.num_pages)
        yield _gauge("splitspec_prefix_cache_pages",
                     "KV pages the prefix cache holds (shared by running sequences, or evictable).",
                     state.prefix_cache.get("cached_pages", 0))
        yield _gauge("splitspec_drafter_up", "1 when the drafter is handshaken and speculating, else 0.",
                     1 if state.drafter_up else 0)
        layout = state.layout
        info = InfoMetricFamily("splitspec_kv_layout", "The agreed KV-cache layout.")
        info.add_metric([], {"order": layout.order, "kv_dtype": layout.kv_dtype, "page_size": str(layout.page_size),
                             "num_pages": str(layout.num_pages), "epoch": str(layout.epoch)})
        yield info


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
