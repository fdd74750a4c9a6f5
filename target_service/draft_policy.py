"""How many drafts to ask for in a step: the adaptive speculation policy.

Asking each of n decoding sequences for k drafts pays when the step's expected emitted
tokens per second beat those of a step without drafts:

    tokens(k)  = n · (1 + Σ_{i=1..k} Π_{j=1..i} p_j)
    seconds(k) = forward(base + n·k) + propose(n·(k+1)) − prefill   (k ≥ 1; seconds(0) = forward(base) − prefill)
    prefill    = forward(base) − forward(n): the step's prefill chunks, done whatever k
    k*         = argmax_{0 ≤ k ≤ K} tokens(k) / seconds(k)      (k = 0 unless k* beats it by `min_gain`;
                 then the longest k whose rate is within `min_gain` of k*'s)

- p_j: P(draft j accepted | drafts 1..j-1 accepted), from discounted counts per draft
  position over the verifies of the current drafter epoch (`AcceptanceEstimate`); a probe
  tests the k an optimistic view of them would choose (`DraftPolicy`).
- forward(T): measured seconds of one forward of the n sequences with T query tokens in
  all (`BatchCostTables`: per batch size, the median of each width's recent samples,
  monotone and piecewise linear between measured widths).
- propose(W): the measured `Propose` round trip by draft positions asked (n·(k+1)),
  transport included, in steady state (every sequence drafted last step too).
- catch-up: a step without drafts sends no Propose, so the first drafting step after a
  stretch of none makes the drafter catch up on that context: seconds per row (learnt from
  those Proposes) times each sequence's rows, spread over the steps it may still draft.

Only how many drafts are asked changes: the accept/reject rule is untouched, so the
output is the same whatever the policy decides. `fixed` always asks for K. The measurements
behind each rule below: docs/performance.md#the-adaptive-policys-rules.
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics
from dataclasses import dataclass, field

import splitspec.contract as defaults

SPECULATIVE_POLICIES = defaults.SPECULATIVE_POLICIES


def expected_tokens(acceptance: list[float], k: int) -> float:
    """Tokens one sequence emits from k drafts: 1 + Σ_{i≤k} Π_{j≤i} p_j (the bonus token included)."""
    total, survive = 1.0, 1.0
    for p in acceptance[:k]:
        survive *= p
        total += survive
    return total


def choose_num_drafts(acceptance: list[float], max_k: int, num_seqs: int, base_tokens: int,
                      forward_seconds, propose_seconds, min_gain: float = 0.0, catch_up_seconds: float = 0.0) -> int:
    """The k in 0..max_k maximizing expected tokens per second of the step (pure).

    acceptance: p_1..p_K; num_seqs: the decoding sequences that would draft; base_tokens: the
    step's query tokens without drafts; forward_seconds(T), propose_seconds(W): cost estimates;
    catch_up_seconds: what drafting at all adds this step (the drafter catching up on context)."""
    if max_k <= 0 or num_seqs <= 0:
        return 0
    # Prefill chunks in the step (base_tokens beyond one per decoding sequence) are work it does
    # whatever k: left out of every rate, so drafts are judged against decoding alone (counted
    # in, a long prefill makes a Propose look cheap).
    step = forward_seconds(base_tokens)
    if not math.isfinite(step):
        return 0  # a step wider than any priced (CostTable.reach): drafts cannot be priced against it
    prefill = max(0.0, step - forward_seconds(num_seqs)) if base_tokens > num_seqs else 0.0
    plain = num_seqs / (step - prefill)
    rates = [plain]  # by k
    tokens, survive = 1.0, 1.0  # expected_tokens(acceptance, k), accumulated as k grows
    for k in range(1, max_k + 1):
        survive *= acceptance[k - 1]
        tokens += survive
        seconds = (forward_seconds(base_tokens + num_seqs * k) - prefill + propose_seconds(num_seqs * (k + 1))
                   + catch_up_seconds)
        rates.append(num_seqs * tokens / seconds)
    best = max(range(1, max_k + 1), key=rates.__getitem__)
    if rates[best] <= plain * (1.0 + min_gain):
        return 0  # drafts must beat no drafts by min_gain: a measured cost is noisy, a Propose is not free
    # The longest draft within min_gain of the best: where a verify and a Propose cost about the
    # same at every width, rates differ by the noise of their per-width estimates (the wider
    # widths measured least), and the longer draft emits more tokens for the step's fixed costs.
    return max(k for k in range(best, max_k + 1) if rates[k] >= rates[best] * (1.0 - min_gain))


@dataclass
class AcceptanceEstimate:
    """p_j per draft position from discounted counts, with how sure each one is.

    A verified sequence adds a trial at positions 1..accepted+1 (hits at the accepted, a miss
    at the first rejected; later positions were not tried). Every decision discounts the
    evidence by 1 − 1/`window`, so old evidence fades and doubt returns: while drafts are
    verified, the counts themselves; while none are (no drafts pay), only the confidence in
    them (`optimistic()` widens, the estimates stay where the last evidence left them), folded
    into the counts when evidence comes again. Estimates that drifted back to the prior with
    nothing tried made the policy draft a whole batch again on no evidence; a probe is how one
    sequence tests the doubt. A position's estimate is shrunk toward the pooled rate by
    `strength` pseudo-trials (the pooled rate toward `prior`); `optimistic()` adds `z`
    standard errors: what a probe tests."""

    max_k: int
    window: float = 256.0  # decisions for a count to fade to 1/e
    prior: float = 0.6
    strength: float = 2.0
    z: float = 1.0
    _hits: list[float] = field(default_factory=list)
    _trials: list[float] = field(default_factory=list)
    _confidence: float = 1.0  # the faded weight of the counts since the last evidence
    _observed: bool = False  # evidence came since the last decision

    def __post_init__(self) -> None:
        if self.window < 1 or not 0.0 <= self.prior <= 1.0 or self.strength <= 0:
            raise ValueError(f"window must be >= 1, prior in [0, 1] and strength > 0, got {self.window}, "
                             f"{self.prior}, {self.strength}")
        self.reset()

    def reset(self) -> None:
        self._hits = [0.0] * self.max_k
        self._trials = [0.0] * self.max_k
        self._confidence, self._observed = 1.0, False

    def observe(self, num_draft: int, num_accepted: int) -> None:
        if self._confidence < 1.0:  # the doubt accrued while nothing was tried weighs the old counts now
            self._scale(self._confidence)
            self._confidence = 1.0
        self._observed = True
        for j in range(min(num_accepted + 1, num_draft, self.max_k)):
            self._trials[j] += 1.0
            self._hits[j] += 1.0 if j < num_accepted else 0.0

    def age(self, decisions: int = 1, idle_window: float | None = None) -> None:
        """`decisions` more made; without evidence since the last, the confidence fades over
        `idle_window` decisions instead of `window` when that is longer (the policy passes its
        gap between probes: doubt grows no faster than probes may test it)."""
        if self._observed:
            self._scale((1.0 - 1.0 / self.window) ** decisions)
            self._observed = False
        else:
            window = max(self.window, idle_window or 0.0)
            self._confidence *= (1.0 - 1.0 / window) ** decisions

    def _scale(self, keep: float) -> None:
        self._hits = [h * keep for h in self._hits]
        self._trials = [t * keep for t in self._trials]

    def trials(self, position: int) -> float:
        """Discounted trials at draft position `position` (1-based), doubt included."""
        return self._trials[position - 1] * self._confidence

    @property
    def values(self) -> list[float]:
        pooled = (sum(self._hits) + self.strength * self.prior) / (sum(self._trials) + self.strength)
        return [(h + self.strength * pooled) / (t + self.strength) for h, t in zip(self._hits, self._trials)]

    def optimistic(self) -> list[float]:
        """Each p_j plus `z` standard errors (the widest a Bernoulli can have, 0.5/√n, so that a
        position observed only rejecting, p ≈ 0, still carries its doubt) of its discounted trials."""
        return [min(1.0, p + self.z * 0.5 / math.sqrt(t * self._confidence + self.strength))
                for p, t in zip(self.values, self._trials)]


def isotonic(values: list[float], weights: list[float] | None = None) -> list[float]:
    """The non-decreasing sequence closest to `values` in weighted squared error (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights or [1.0] * len(values)):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2, n2), (m1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [mean for mean, _, count in blocks for _ in range(int(count))]


@dataclass
class CostTable:
    """Seconds by a width (query tokens, draft positions): the median of each measured
    width's last `window` samples.

    A median, not a running mean, so one stall moves nothing. Estimates are monotone in the
    width (noise cannot make drafts look free): the isotonic fit of the per-width medians,
    each weighted by its samples (up to `max_weight`), so a width measured once yields to
    those measured all along; the policy probes a width until it holds `max_weight` samples
    (DraftPolicy.decide). Between measured widths the fit is linear, below the narrowest flat,
    beyond the widest extended by the last slope (or `prior_slope` × the widest's seconds per
    unit when only one is known); past `reach` × the widest it is infinite, so the policy
    widens its steps gradually, each width measured before a wider one is tried."""

    window: int = 9
    prior_slope: float = 0.15
    max_widths: int = 4096  # widths are bounded by the token budget; this bounds the table regardless
    reach: float = 2.0
    max_weight: float = 8.0
    _samples: dict[int, collections.deque] = field(default_factory=dict)  # width → its last `window` seconds
    _seconds: dict[int, float] = field(default_factory=dict)  # width → the median of its samples
    _narrowest: int | None = None
    _fit: tuple[list[int], list[float]] | None = None  # (widths, isotonic values) until the next observe

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not 1 <= self.max_weight <= self.window:
            raise ValueError(f"max_weight must be in [1, window={self.window}] (a weight counts the samples kept), "
                             f"got {self.max_weight}")

    def observe(self, width: int, seconds: float) -> None:
        if width <= 0 or seconds < 0:
            return
        samples = self._samples.get(width)
        if samples is None:
            if len(self._samples) >= self.max_widths:
                return
            samples = self._samples[width] = collections.deque(maxlen=self.window)
        samples.append(seconds)
        self._seconds[width] = statistics.median(samples)
        if self._narrowest is None or width < self._narrowest:
            self._narrowest = width
        self._fit = None

    def clear(self) -> None:
        self._samples.clear()
        self._seconds.clear()
        self._narrowest = None
        self._fit = None

    def _fitted(self) -> tuple[list[int], list[float]]:
        """Fitted once per change, not per estimate: a decision asks for 2·(K+1) estimates."""
        if self._fit is None:
            widths = sorted(self._seconds)
            weights = [self.weight(w) for w in widths]
            self._fit = widths, isotonic([self._seconds[w] for w in widths], weights)
        return self._fit

    @property
    def known(self) -> bool:
        return bool(self._seconds)

    def weight(self, width: int) -> float:
        """How much the fit trusts this width's own samples: min(samples kept, max_weight)."""
        samples = self._samples.get(width)
        return min(len(samples), self.max_weight) if samples else 0.0

    def below_measured(self, width: int) -> bool:
        """Narrower than every measured width: its estimate is only the narrowest's, a bound."""
        return self._narrowest is not None and width < self._narrowest

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
class BatchCostTables:
    """Forward seconds by batch size (decoding sequences) and width (query tokens): one
    `CostTable` per batch size.

    A width's cost depends on how many sequences share it (each brings its own attention over
    its own context), so a batch size is never priced from another's widths; one measured
    nowhere is not priced at all (`DraftPolicy.decide` measures its plain step first)."""

    max_batches: int = 1024  # batch sizes are bounded by max_num_seqs; this bounds the tables regardless
    window: int = 9
    _tables: dict[int, CostTable] = field(default_factory=dict)

    def table(self, num_seqs: int) -> CostTable:
        """The table of this batch size (an empty one, not kept, past `max_batches`)."""
        table = self._tables.get(num_seqs)
        if table is None:
            table = CostTable(window=self.window)
            if len(self._tables) < self.max_batches:
                self._tables[num_seqs] = table
        return table

    @property
    def known(self) -> bool:
        return any(table.known for table in self._tables.values())

    def observe(self, num_seqs: int, width: int, seconds: float) -> None:
        if num_seqs > 0:
            self.table(num_seqs).observe(width, seconds)

    def clear(self) -> None:
        self._tables.clear()


@dataclass(frozen=True)
class Decision:
    """A step's drafts: k for every decoding sequence, and `probe_k` (> k) for one of them
    when the step probes (0 otherwise)."""

    k: int
    probe_k: int = 0


@dataclass
class DraftPolicy:
    """Decides k per step from what the engine measured; `fixed` always answers max_k.

    Exploration is optimism under uncertainty: when a probe is due and the k chosen with
    each p_j `z` standard errors higher is larger, one sequence drafts it and its verify
    teaches the positions nobody tried; where even that does not pay, nothing is probed.
    Probes are due every `probe_every` decisions while drafts pay; while none do, each probe
    doubles the gap, up to `max_probe_every`, so k = 0 is never forever and a drafter that
    never pays costs next to nothing."""

    max_k: int
    adaptive: bool = True
    probe_every: int = 16  # decisions from one probe to the next while drafts pay
    max_probe_every: int = 256  # the longest gap between probes, reached while none pay
    min_gain: float = 0.02
    catch_up_horizon: int = 16  # steps a sequence's catch-up is spread over (fewer if it ends sooner)
    acceptance: AcceptanceEstimate = field(init=False)
    forward: BatchCostTables = field(default_factory=BatchCostTables)
    propose: CostTable = field(default_factory=CostTable)  # by draft positions, n·(k+1)
    catch_up_alpha: float = 0.3
    catch_up_per_row: float | None = None  # seconds, an EWMA (`catch_up_alpha`) over catching-up Proposes
    recheck_every: int = 8  # while no drafts pay, steps of the same batch that keep k = 0 before deciding again
    probe_budget: float = 0.01  # while no drafts pay, the share of time probes may cost (stretches the gap)
    _since_probe: int = 0
    _probe_gap: int = 0  # decisions from one probe to the next (0: not started, probe_every)
    _idle_batch: object = None  # the batch the last k = 0 decision was made for (the caller's description)
    _idle_left: int = 0  # steps that may still keep it (`keeps_no_drafts`)
    _ages_owed: int = 0  # decisions kept without deciding: the acceptance counts age by them at the next
    _probe_declined: bool = False  # the last decision had a probe due and found none worth asking
    _last_k: int | None = None  # the last decision's k (None: none made yet)
    _probe_seconds: float = 0.0  # what the last probe's Propose took (`record_probe`)

    def __post_init__(self) -> None:
        if (self.max_k < 0 or not 1 <= self.probe_every <= self.max_probe_every or self.min_gain < 0
                or self.catch_up_horizon < 1 or not 0 < self.catch_up_alpha <= 1 or self.recheck_every < 0
                or not 0 < self.probe_budget <= 1):
            raise ValueError(f"max_k must be >= 0, 1 <= probe_every <= max_probe_every, min_gain >= 0, "
                             f"catch_up_horizon >= 1, 0 < catch_up_alpha <= 1, recheck_every >= 0 and "
                             f"0 < probe_budget <= 1, got {self.max_k}, {self.probe_every}, {self.max_probe_every}, "
                             f"{self.min_gain}, {self.catch_up_horizon}, {self.catch_up_alpha}, {self.recheck_every}, "
                             f"{self.probe_budget}")
        self.acceptance = AcceptanceEstimate(self.max_k)

    def new_epoch(self) -> None:
        """A new drafter (or the same one re-attached): its acceptance is learnt afresh."""
        self.acceptance.reset()
        self._idle_left = self._ages_owed = 0
        self._last_k = None
        self.propose.clear()
        self.catch_up_per_row = None

    @property
    def idle(self) -> bool:
        """No drafts pay: the last decision asked none, and so did a probe since (the gap between
        probes has grown past `probe_every`, which it does only while probes find nothing), or
        even the optimistic view found no probe worth asking."""
        return self.adaptive and self._last_k == 0 and (self._probe_gap > self.probe_every or self._probe_declined)

    def keeps_no_drafts(self, batch: object) -> bool:
        """Whether this step keeps the last decision's k = 0 without deciding again (it counts as a
        decision): within `recheck_every` steps of it, for the same `batch` (the caller's
        description, compared for equality), no probe due. While no drafts pay, nothing a step
        without drafts measures can make them pay (only its own width's cost and the catch-up
        grow), so deciding every step would cost the step's bookkeeping for the same answer."""
        if self._idle_left <= 0 or batch != self._idle_batch:
            return False
        if self._since_probe + 1 >= (self._probe_gap or self.probe_every):
            return False  # a probe is due: decide
        self._idle_left -= 1
        self._since_probe += 1
        self._ages_owed += 1
        return True

    def steps_until_probe(self) -> int:
        """Decisions before the next probe comes due (0: due at the next one)."""
        return max(0, (self._probe_gap or self.probe_every) - self._since_probe - 1)

    def pass_step_without_decision(self) -> None:
        """A step with no sequence to decide for (none followed, as while no drafts pay), which counts
        toward the next probe and ages acceptance as a kept k = 0 decision does."""
        self._since_probe += 1
        self._ages_owed += 1

    def decide(self, num_seqs: int, base_tokens: int, max_k: int, catch_up_rows: float = 0.0,
               batch_seqs: int | None = None, batch: object = None) -> Decision:
        """k for this step's `num_seqs` decoding sequences that may draft; `base_tokens`: the step's
        query tokens without drafts; `max_k`: the most drafts anyone may ask for now, as the
        caller bounded it (Speculation.draft_limit; at most the policy's K); `catch_up_rows`: context rows the drafter would catch up on, each divided
        by the steps its sequence may still draft (`amortized_rows`); `batch_seqs`: the step's
        sequences in all, drafting or not (default `num_seqs`), whose cost table prices it; `batch`:
        the caller's description of the step's batch, which a k = 0 decision is kept for
        (`keeps_no_drafts`; None: not kept)."""
        if max_k > self.max_k:
            raise ValueError(f"max_k {max_k} exceeds the policy's K {self.max_k}: the caller bounds k")
        self._idle_left = 0
        if not self.adaptive or max_k <= 0:
            self._last_k = max(max_k, 0)
            return Decision(self._last_k)
        self.acceptance.age(1 + self._ages_owed, idle_window=self._probe_gap)
        self._ages_owed = 0
        decision = self._decide(num_seqs, base_tokens, max_k, catch_up_rows, batch_seqs)
        self._last_k = decision.k
        if decision == Decision(0) and batch is not None:
            self._idle_batch, self._idle_left = batch, self.recheck_every
        return decision

    def _decide(self, num_seqs: int, base_tokens: int, max_k: int, catch_up_rows: float,
                batch_seqs: int | None) -> Decision:
        if not (self.forward.known and self.propose.known):
            return Decision(max_k)  # nothing measured yet: speculate, which measures both
        forward = self.forward.table(num_seqs if batch_seqs is None else batch_seqs)
        if not forward.known or forward.below_measured(base_tokens):
            # A batch size never measured is not priced from another's widths (BatchCostTables),
            # and a step without drafts narrower than any measured would be priced as the narrowest
            # measured (an upper bound): drafts would look free. Measure it once first.
            return Decision(0)
        catch_up = catch_up_rows * (self.catch_up_per_row or 0.0)
        k = self._best_k(forward, self.acceptance.values, num_seqs, base_tokens, max_k, catch_up)
        self._since_probe += 1
        self._probe_declined = False
        if self._since_probe < (self._probe_gap or self.probe_every):
            return Decision(k)
        probe_k = self._best_k(forward, self.acceptance.optimistic(), num_seqs, base_tokens, max_k, catch_up)
        if probe_k <= k:
            if not (0 < k < max_k and forward.weight(base_tokens + num_seqs * k + 1) < forward.max_weight):
                # Even the optimistic view asks no more: nothing a probe could teach. The next probe
                # is a gap away, as after one asked: only the doubt that grows meanwhile can change
                # this answer, and while the probe is due every step (it was) the engine follows
                # every new sequence for it (Speculation._follows_from_admission), paying each step
                # its capture and bookkeeping for a probe that is never asked.
                self._probe_declined = True
                self._start_probe_gap(forward, base_tokens, k)
                return Decision(k)
            # Acceptance has nothing to teach, but one draft more would measure a width the cost
            # table barely knows (it leans on its neighbours until measured max_weight times).
            probe_k = k + 1
        self._start_probe_gap(forward, base_tokens, k)
        return Decision(k, probe_k)

    def _start_probe_gap(self, forward: CostTable, base_tokens: int, k: int) -> None:
        """A probe was asked or declined: the next is `probe_every` decisions away while drafts pay,
        else twice the last gap (`_longest_probe_gap` at most)."""
        self._since_probe = 0
        gap = self._probe_gap or self.probe_every
        self._probe_gap = min(2 * gap, self._longest_probe_gap(forward.estimate(base_tokens))) if k == 0 \
            else self.probe_every

    def _longest_probe_gap(self, step_seconds: float) -> int:
        """While no drafts pay, probes are spaced at most `max_probe_every` decisions apart, or as far
        as keeps their cost within `probe_budget` of the time: a probe's Propose catches the drafter
        up on its sequence's whole context, which a drafter that has slept a while computes slowly
        (on a 2-core Xeon: 3-9 ms, ten decode steps)."""
        if step_seconds <= 0:
            return self.max_probe_every
        return max(self.max_probe_every, math.ceil(self._probe_seconds / (self.probe_budget * step_seconds)))

    def _best_k(self, forward: CostTable, acceptance: list[float], num_seqs: int, base_tokens: int, max_k: int,
                catch_up_seconds: float) -> int:
        return choose_num_drafts(acceptance, max_k, num_seqs, base_tokens, forward.estimate,
                                 self.propose.estimate, self.min_gain, catch_up_seconds)

    def amortized_rows(self, rows_behind: int, steps_left: int) -> float:
        """A sequence's catch-up rows charged to one step: spread over the steps it may still
        draft, at most `catch_up_horizon` (one that ends in 2 steps repays it over 2)."""
        return rows_behind / max(1, min(self.catch_up_horizon, steps_left))

    def forget_measurements(self) -> None:
        """Drop everything measured (after warmup, whose first calls pay one-time costs)."""
        self.new_epoch()
        self.forward.clear()
        self._since_probe = self._probe_gap = 0
        self._probe_seconds = 0.0

    def record_forward(self, num_seqs: int, query_tokens: int, seconds: float) -> None:
        """A decode or verify forward of `num_seqs` sequences and `query_tokens` tokens in all."""
        self.forward.observe(num_seqs, query_tokens, seconds)

    def record_propose(self, draft_positions: int, seconds: float) -> None:
        """A Propose whose drafting sequences were all caught up: the steady-state cost."""
        self.propose.observe(draft_positions, seconds)

    def record_catch_up(self, draft_positions: int, rows: int, seconds: float) -> None:
        """A Propose that also caught the drafter up on `rows` context rows: what it took over the
        steady-state cost of its draft positions, per row."""
        if rows <= 0 or seconds < 0:
            return
        steady = self.propose.estimate(draft_positions) if self.propose.known else 0.0
        per_row = max(0.0, seconds - steady) / rows
        old = self.catch_up_per_row
        self.catch_up_per_row = per_row if old is None else old + self.catch_up_alpha * (per_row - old)

    def record_probe(self, seconds: float) -> None:
        """What a probing step's Propose took, its catch-up included (`_longest_probe_gap`)."""
        if seconds >= 0:
            self._probe_seconds = seconds

    def record_verify(self, num_draft: int, num_accepted: int) -> None:
        self.acceptance.observe(num_draft, num_accepted)
