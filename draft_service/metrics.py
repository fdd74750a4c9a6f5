"""Prometheus metrics of the drafter, in its own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PROPOSE_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WARMUP_BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0, 60.0, 300.0, 1200.0)
HANDSHAKE_STATES = ("loading", "waiting", "negotiated", "attached")


class DrafterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.propose_latency = Histogram("splitspec_draft_propose_latency_seconds",
                                         "Time to serve one Propose inside the drafter.", buckets=PROPOSE_BUCKETS,
                                         registry=r)
        self.propose_batch = Histogram("splitspec_draft_propose_batch_size",
                                       "Sequences asking for drafts in one Propose.", buckets=BATCH_BUCKETS, registry=r)
        self.draft_tokens = Counter("splitspec_draft_tokens", "Draft tokens proposed.", registry=r)
        self.mapped_bytes = Gauge("splitspec_draft_mapped_bytes", "Bytes of the target's KV pool mapped.", registry=r)
        self.handshake_state = Gauge("splitspec_draft_handshake_state",
                                     "1 for the drafter's current handshake state, 0 for the others.", ["state"],
                                     registry=r)
        self.epoch = Gauge("splitspec_draft_epoch", "Handshake generation of the current attachment.", registry=r)
        self.attaches = Counter("splitspec_draft_attaches", "Attach calls by result.", ["result"], registry=r)
        self.warmup_seconds = Histogram("splitspec_draft_attention_warmup_seconds",
                                        "Attention warm-up on scratch pages at Attach, before it answers "
                                        "(FlashInfer compiles its kernels here on first use).",
                                        buckets=WARMUP_BUCKETS, registry=r)
        self.set_state("loading")

    def set_state(self, state: str) -> None:
        for name in HANDSHAKE_STATES:
            self.handshake_state.labels(state=name).set(1 if name == state else 0)
