"""How many drafts to ask for in a step: the adaptive speculation policy.

Asking each of n decoding sequences for k drafts pays when the step's expected emitted
tokens per second beat those of a step without drafts:

    tokens(k)  = n · (1 + Σ_{i=1..k} Π_{j=1..i} p_j)
    seconds(k) = forward(base + n·k) + propose(n·(k+1))      (k ≥ 1; seconds(0) = forward(base))
    k*         = argmax_{0 ≤ k ≤ K} tokens(k) / seconds(k)      (k = 0 unless k* beats it by `min_gain`)

- p_j: P(draft j accepted | drafts 1..j-1 accepted), an exponentially weighted estimate
  per draft position over the verifies of the current drafter epoch (`AcceptanceEstimate`).
- forward(T): measured seconds of one forward with T query tokens in all (`CostTable`,
  an EWMA per width, monotone and piecewise linear between measured widths).
- propose(W): the measured `Propose` round trip by draft positions asked (n·(k+1)),
  transport included. A step without drafts sends none (speculation.py defers its
  context to the next Propose that asks for drafts, whose measured cost includes it).

Only how many drafts are asked changes: the accept/reject rule is untouched, so the
output is the same whatever the policy decides. `fixed` always asks for K (the policy
before this one).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

SPECULATIVE_POLICIES = ("adaptive", "fixed")


def expected_tokens(acceptance: list[float], k: int) -> float:
    """Tokens one sequence emits from k drafts: 1 + Σ_{i≤k} Π_{j≤i} p_j (the bonus token included)."""
    total, survive = 1.0, 1.0
    for p in acceptance[:k]:
        survive *= p
        total += survive
    return total


def choose_num_drafts(acceptance: list[float], max_k: int, num_seqs: int, base_tokens: int,
                      forward_seconds, propose_seconds, min_gain: float = 0.0) -> int:
    """The k in 0..max_k maximizing expected tokens per second of the step (pure).

    acceptance: p_1..p_K; num_seqs: the decoding sequences that would draft; base_tokens: the
    step's query tokens without drafts; forward_seconds(T), propose_seconds(W): cost estimates."""
    if max_k <= 0 or num_seqs <= 0:
        return 0
    best_k = 0
    best_rate = num_seqs / forward_seconds(base_tokens)
    threshold = best_rate * (1.0 + min_gain)
    for k in range(1, max_k + 1):
        seconds = forward_seconds(base_tokens + num_seqs * k) + propose_seconds(num_seqs * (k + 1))
        rate = num_seqs * expected_tokens(acceptance, k) / seconds
        if rate > threshold and rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


@dataclass
class AcceptanceEstimate:
    """p_j per draft position, exponentially weighted over verifies (unobserved positions: the prior)."""

    max_k: int
    alpha: float = 0.2  # per verified sequence: a batch of n learns n times per step
    prior: float = 0.6
    _p: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._p = [self.prior] * self.max_k

    @property
    def values(self) -> list[float]:
        return list(self._p)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """Positions 1..accepted were accepted; position accepted+1 (if drafted) was rejected.
        Later positions were not tried, so they say nothing about p_j conditioned on them."""
        for j in range(min(num_accepted + 1, num_draft, self.max_k)):
            hit = 1.0 if j < num_accepted else 0.0
            self._p[j] += self.alpha * (hit - self._p[j])


def isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in squared error (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [mean for mean, count in blocks for _ in range(int(count))]


@dataclass
class CostTable:
    """Seconds by a width (query tokens, draft positions): an EWMA per measured width.

    Estimates are monotone in the width (a wider step never looks cheaper than a narrower
    one, so noise cannot make drafts look free): the isotonic fit of the per-width means
    (adjacent widths out of order are pooled into their mean, so one slow outlier raises
    its neighbours a little instead of every wider width to its own value), linear between
    measured widths, flat below the narrowest, and beyond the widest extended by the last
    slope, or by `prior_slope` × (seconds per unit of the widest) when only one is known.
    Past `reach` × the widest, nothing is extrapolated (infinite cost): a batch eight times
    the size of any measured is not priced from a slope fitted at batch 1, so the policy
    widens its steps gradually, each new width measured before a wider one is tried."""

    alpha: float = 0.3
    prior_slope: float = 0.15
    max_widths: int = 4096  # widths are bounded by the token budget; this bounds the table regardless
    reach: float = 2.0
    _seconds: dict[int, float] = field(default_factory=dict)
    _fit: tuple[list[int], list[float]] | None = None  # (widths, isotonic values) until the next observe

    def observe(self, width: int, seconds: float) -> None:
        if width <= 0 or seconds < 0:
            return
        old = self._seconds.get(width)
        if old is None:
            if len(self._seconds) >= self.max_widths:
                return
            self._seconds[width] = seconds
        else:
            self._seconds[width] = old + self.alpha * (seconds - old)
        self._fit = None

    def clear(self) -> None:
        self._seconds.clear()
        self._fit = None

    def _fitted(self) -> tuple[list[int], list[float]]:
        """Fitted once per change, not per estimate: a decision asks for 2·(K+1) estimates."""
        if self._fit is None:
            widths = sorted(self._seconds)
            self._fit = widths, isotonic([self._seconds[w] for w in widths])
        return self._fit

    @property
    def known(self) -> bool:
        return bool(self._seconds)

    def estimate(self, width: int) -> float:
        if not self._seconds:
            return 0.0
        widths, values = self._fitted()
        if width > self.reach * widths[-1]:
            return math.inf
        if width <= widths[0]:
            return values[0]
        if width >= widths[-1]:
            if len(widths) >= 2:
                slope = (values[-1] - values[-2]) / (widths[-1] - widths[-2])
            else:
                slope = self.prior_slope * values[-1] / widths[-1]
            return values[-1] + slope * (width - widths[-1])
        i = bisect.bisect_left(widths, width)
        if widths[i] == width:
            return values[i]
        lo, hi = widths[i - 1], widths[i]
        return values[i - 1] + (values[i] - values[i - 1]) * (width - lo) / (hi - lo)


@dataclass
class DraftPolicy:
    """Decides k per step from what the engine measured; `fixed` always answers max_k."""

    max_k: int
    adaptive: bool = True
    probe_every: int = 16  # decisions between probes while drafting pays
    max_probe_every: int = 256  # the longest gap between probes, reached while none pays
    min_gain: float = 0.02
    acceptance: AcceptanceEstimate = field(init=False)
    forward: CostTable = field(default_factory=CostTable)
    propose: CostTable = field(default_factory=CostTable)
    _steps: int = 0
    _probe_gap: int = 0  # decisions from one probe to the next (0: not started, probe_every)
    _next_probe: int = 0  # the decision that probes
    probing: bool = False  # the last decision was a probe (speculation.py asks one sequence only)

    def __post_init__(self) -> None:
        self.acceptance = AcceptanceEstimate(self.max_k)

    def new_epoch(self) -> None:
        """A new drafter (or the same one re-attached): its acceptance is learnt afresh."""
        self.acceptance.reset()
        self.propose.clear()

    def decide(self, num_seqs: int, base_tokens: int, max_k: int) -> int:
        """k for this step's `num_seqs` decoding sequences; `base_tokens`: the step's query tokens
        without drafts; `max_k`: the most drafts anyone may ask for now (≤ the policy's K)."""
        max_k = min(max_k, self.max_k)
        self.probing = False
        if not self.adaptive or max_k <= 0:
            return max(max_k, 0)
        self._steps += 1
        if not (self.forward.known and self.propose.known):
            return max_k  # nothing measured yet: speculate, which measures both
        k = choose_num_drafts(self.acceptance.values, max_k, num_seqs, base_tokens,
                              self.forward.estimate, self.propose.estimate, self.min_gain)
        if not self._probe_gap:
            self._probe_gap = self._next_probe = self.probe_every
        if self._steps >= self._next_probe:
            # Keep exploring: an estimate only learns from the k that runs, so now and then run a
            # neighbour of the choice (one draft more, or none when at K). A drafter that got
            # better, or a cost that fell, can then win back its k; k = 0 is not forever. While
            # no draft pays, each probe that confirms it doubles the gap to the next: a probe
            # costs a verify and a Propose, and a drafter that never pays must cost ~nothing.
            self._probe_gap = min(2 * self._probe_gap, self.max_probe_every) if k == 0 else self.probe_every
            self._next_probe = self._steps + self._probe_gap
            k = k + 1 if k < max_k else 0
            self.probing = True
        return k

    def forget_measurements(self) -> None:
        """Drop everything measured (after warmup, whose first calls pay one-time costs)."""
        self.acceptance.reset()
        self.forward.clear()
        self.propose.clear()
        self._steps = self._probe_gap = self._next_probe = 0

    def record_forward(self, query_tokens: int, seconds: float) -> None:
        self.forward.observe(query_tokens, seconds)

    def record_propose(self, draft_positions: int, seconds: float) -> None:
        self.propose.observe(draft_positions, seconds)

    def record_verify(self, num_draft: int, num_accepted: int) -> None:
        self.acceptance.observe(num_draft, num_accepted)
