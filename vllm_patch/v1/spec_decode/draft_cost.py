"""Grammar-aware drafting's cost model: a batch drafts under the grammar only
while the expected gain in output speed exceeds the measured cost.

Both sides are measured on the running worker, per step of its drafter:

- gain: how much faster a walked request moves through its output. A draft
  is changed only where the drafter's own token is one the grammar refuses
  (masked drafts, forced tokens), and the target, masked by the committed
  grammar, rejects such a token for certain; so without the feature the
  request would have accepted at most up to its first changed position,
  and every accepted draft after it (g of them) is gain (exact for greedy
  targets; an estimate for sampled ones). The request committed t tokens
  where it would have committed t - g: in that step it moved g / (t - g)
  of a stock step further, and that ratio, averaged over the walked
  requests and steps, is its speed-up. Not g over the tokens: a request
  that walks passes faster through the parts of its output where the walk
  helps (a drafter that leaves the grammar), so fewer of its steps are
  spent there, and a ratio of tokens counts the steps as they fall with
  the walk on. Measured at a 131k vocabulary, B=128, k=4 (the cost
  benchmark's always-on lane): accepted drafts after a change over the
  batch's tokens read +21 %, the mean of g / (t - g) +70 %, the lanes'
  tokens per step differed by +74 %.
- cost: this process's thread CPU time in the feature's hooks (advancing
  the shadows, the walk, the rollback; on a CPU device that includes the
  device work it adds, such as the candidates' top-k) per shadowed request
  per step, plus the device-to-host synchronisations it adds (one to read
  the step's sampled tokens, at most one per draft position) at a modelled
  price (`VLLM_PATCH_DRAFT_SYNC_US`; 0 when the device is the CPU: there is
  nothing to wait for). Measured per step, not assumed. Plus the
  verification rows the walk adds to the scheduler's work: stock's
  scheduler cuts a request's drafts at the first one its grammar refuses,
  so the drafts handed over after the first changed position each get a
  bitmask row that stock would not fill. Such a row is priced at what a
  row cost the scheduler's engine thread on its own last walks
  (`parallel_rows.row_ns`: the wall time per row of its verification
  walks, threaded or serial as they ran), where this process holds the
  scheduler's manager (the in-process executor: one GPU per engine). A
  row filled on the drafter's side is 2-4x off that either way: one fill
  right after the walk read 48-66 us at a 32k vocabulary where the
  scheduler's added rows cost 15-26 (cold caches, a document's first
  position), and a fill along the drafts read 12-21 us at 131k where they
  cost 44-52 (the scheduler writes each row into its batch's bitmask, 16
  KB a row). Where the scheduler is in another process (a multiprocess
  worker), a row is priced at one row fill of a shadow, measured every
  `FILL_SAMPLE_EVERY` walking steps (the same grammar, the same
  vocabulary), a serial fill's price. Only walking
  steps' costs are averaged (a step that does not walk costs the shadows'
  advance only: not what walking costs). The
  shadows' upkeep (advancing every shadow by the step's tokens, reading
  them, the pass over the batch's rows before the decision) is priced per
  shadow, the walk per walked row: a step that walks
  a sample of the rows prices the walk on the sample, not on the batch.

Measuring and probing walk a sample: while the cost model has not measured
enough (the first walking steps of a batch, below) and on a probe step
while off, a batch of more than `SAMPLE_ROWS` structured rows walks only a
sample of them (a window that rotates over the rows from one such step to
the next), the others draft as in stock. Samples come in two sizes,
`SAMPLE_ROWS` and `LARGE_SAMPLE_ROWS`, in turn (the first measuring step
the small one, the second the large one, and so on for the probes): a
walking step costs a
fixed part (the write-back of the drafts, the concatenation before the
candidates are read, one batched grammar call per position, whatever the
number of rows) plus a part per walked row, and one sample size cannot tell
them apart. Measured at a 131k vocabulary, k=4: about 2.2 ms fixed plus
45 us per row; priced per row of a 16-row sample that is about 3 times what
a walk of every row of a batch of 256 costs per row, so the batch stayed
off where walking every row paid. The price per row of a walk of a batch
of R rows: as measured where two walks had R/2 to 2R rows (a batch that
walks every row); else from a line through the samples: each sample size
one point, the low median of its steps' costs, the part per row the slope
from the small to the large, the fixed part what the small one leaves over
it (neither below 0), divided over R; without two sizes (a batch no larger
than a sample) the low median of the walks' costs per row. A batch sampled
in two sizes measures four walking steps (two of each) before it decides.
Gain is measured per row, so a sample measures it as the whole batch would,
at a fraction of the price: at B=256 a measuring or probing step costs 1/16
or 1/4 of a walk of every row.

Estimates are robust to one-off work: the walk's price uses the last
`2 * COST_WINDOW` walking steps, low medians throughout (a step that pays a
one-off, a first-step warm-up, a collection pause, a cache fill, is one
sample among several and never decides alone: the first two walking steps
always run, four where there are two sample sizes, so there are two
samples of each before a decision), the shadows' upkeep per shadow the low
median of its last `COST_WINDOW` steps, the row fill the low median of
its last samples; the gain per row is the mean of
the last `GAIN_WINDOW` walking steps, the prior counting as one step until
the window is full (it follows a batch's real gain within a few steps,
instead of the many an average decaying from the prior needs).

Decision (every step, before drafting): walk the grammar iff
    rows * gain_per_row / requests_per_step
        >  DECISION_MARGIN * cost_this_step / step_time
i.e. the batch's relative gain in output speed (the walked requests'
speed-ups over the batch's requests, each request's output counted as
moving at the same pace) beats the relative growth of the step time (the
batch's requests per step and step time measured between consecutive
steps, each the median of the last `STEP_WINDOW` steps: the step
that builds a batch's shadows, which at B=256 with guidance took 30 times a
normal step, once seeded a moving average that made the walk look cheap for
a dozen steps). The step time is the step as stock would take it: the
time between the steps less what the feature added to it (its host time,
the verification rows it added, its syncs); relative to a step the walk
made longer itself, a walk adding 48 ms to a 69 ms step read as 41 %, not
70 % (131k, guidance, B=256), and the batch walked where it lost 6 %. Off
for a step: the drafts are stock's, the shadows are still advanced; every
`OFF_PROBE_EVERY`th step in a row that is off walks a sample all the same (a probe: it measures the gain again, so that a batch
whose first steps gained nothing, e.g. right after its prefills, comes back
on where the walk pays). Off for `DORMANT_AFTER` steps in a row: the feature goes
dormant, drops every shadow (no cost at all: the requests in flight draft as
in stock for the rest of their life) and re-arms after a back-off (256
steps, doubling up to 16,384 while it keeps going dormant) for the requests
that arrive afterwards, starting from its last measured gain. The regime
(`on`, `off`, `dormant`) and the counters are in the drafter's stats and
in one log line per change of regime.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# Before anything is measured the feature runs (gain assumed, then measured):
# a walked request 1.5x as fast (one more token per step on two).
PRIOR_GAIN_PER_ROW = 0.5
# Steps the batch's step time and requests per step look back on (medians:
# a step that builds a batch's shadows, or its first after the prefills,
# is one sample among several).
STEP_WINDOW = 5
# Walking steps the estimates look back on (see the module docstring).
COST_WINDOW, GAIN_WINDOW, FILL_WINDOW = 5, 16, 3
DORMANT_AFTER = 8
# While off: every this many steps in a row a probe step walks.
OFF_PROBE_EVERY = 4
# Rows a measuring or probing step walks at most, the two sizes in turn
# (see the docstring).
SAMPLE_ROWS = 16
LARGE_SAMPLE_ROWS = 4 * SAMPLE_ROWS
# A shadow's row fill (the price of a verification row) is timed every
# this many walking steps.
FILL_SAMPLE_EVERY = 16
BACKOFF_FIRST, BACKOFF_MAX = 256, 16384
# The walk must gain this many times its measured cost. What the model
# measures leaves out part of the walk's price (the hooks' code outside its
# timers). With a verification row priced at a shadow's fill it read 55 %
# of the step where the cost benchmark's accounting read 68 % (131k, B=128,
# k=4, a 10 ms GPU step; a margin of 1.25 then); with the rows priced at
# the scheduler's own walk (in-process) its cost per walked row read within
# 10 % of the benchmark's (151 against 164 us at 131k, B=128, k=4; 91
# against 100 at 32k), and 1.25 kept stock's drafts where walking gained
# 19 % (131k, B=256, EAGLE).
DECISION_MARGIN = 1.15


def _walk_line(points: deque) -> tuple[float, float] | None:
    """(fixed ns per step, ns per walked row) through the walking steps'
    (rows walked, walk ns) points: each number of rows walked is one point,
    the low median of its steps' costs; the line through the smallest such
    number and the largest, if that is at least twice as many rows, neither
    part below 0; else None."""
    by_rows: dict[int, list[float]] = {}
    for r, n in points:
        by_rows.setdefault(r, []).append(n)
    lo, hi = min(by_rows), max(by_rows)
    if hi < 2 * lo:
        return None
    n_lo = statistics.median_low(by_rows[lo])
    n_hi = statistics.median_low(by_rows[hi])
    per_row = max(0.0, (n_hi - n_lo) / (hi - lo))
    return max(0.0, n_lo - per_row * lo), per_row


def _median(samples: deque, new: float, low: bool) -> float:
    """The median of the window with `new` in it; between two middle
    samples the one that makes the walk look dearer (the shorter step, the
    more requests)."""
    samples.append(new)
    return (statistics.median_low if low else statistics.median_high)(samples)


@dataclass
class DraftCost:
    enabled: bool
    sync_ns: float
    regime: str = "on"
    step: int = 0
    # Measured (medians of the last STEP_WINDOW steps).
    step_ns: float | None = None
    # The batch's requests that committed tokens, per step.
    requests_per_step: float | None = None
    # The walk's price per row for the batch's rows (the line's, see
    # `row_price`), with the shadows' upkeep.
    cost_per_row_ns: float | None = None
    # None until measured (PRIOR_GAIN_PER_ROW stands in).
    gain_per_row: float | None = None
    # One verification row's fill (a shadow's, timed now and then).
    row_fill_ns: float | None = None
    # A verification row's cost on the scheduler's engine thread, as its
    # own walks measured it (in-process executor only; see observe).
    scheduler_row_ns: float | None = None
    # What an added verification row costs the engine thread as a share of
    # a serial row fill: below 1 where the scheduler's walk runs on vLLM's
    # fill threads and measured them cheaper (parallel_rows.row_factor);
    # 1 where it is serial or this process cannot know (multiprocess
    # workers: the scheduler and its measurements are in another process).
    row_factor: float = 1.0
    walked_steps: int = 0
    # (rows walked, walk ns) of the last walking steps, and the upkeep per
    # shadow of the last steps.
    walk_points: deque = field(
        default_factory=lambda: deque(maxlen=2 * COST_WINDOW))
    upkeep_samples: deque = field(
        default_factory=lambda: deque(maxlen=COST_WINDOW))
    step_samples: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    request_samples: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    gain_samples: deque = field(default_factory=lambda: deque(maxlen=GAIN_WINDOW))
    fill_samples: deque = field(default_factory=lambda: deque(maxlen=FILL_WINDOW))
    # This step's accounting (since the last observe).
    host_ns: int = 0
    # ... of it the shadows' upkeep (advance, reads), and how many shadows.
    upkeep_ns: int = 0
    upkeep_shadows: int = 0
    rows: int = 0
    # The rows and draft positions `decide` was asked about.
    batch_rows: int = 0
    positions: int = 0
    # Where the next sample's window starts (it rotates over the rows).
    sample_at: int = 0
    # Sampled steps so far (their size alternates).
    samples_taken: int = 0
    walked: bool = False
    last_step_at: int | None = None
    off_run: int = 0
    rearm_at: int = 0
    backoff: int = BACKOFF_FIRST
    counts: dict[str, int] = field(default_factory=lambda: {
        "steps_on": 0, "steps_off": 0, "steps_probed": 0,
        "steps_sampled": 0, "dormant_periods": 0})

    # -- accounting --------------------------------------------------------
    def charge(self, t0_ns: int, upkeep: bool = False) -> None:
        """Add this thread's CPU time since `t0_ns` (time.thread_time_ns);
        `upkeep`: the shadows' upkeep (every shadow pays it), not the walk
        (only the walked rows)."""
        ns = time.thread_time_ns() - t0_ns
        self.host_ns += ns
        if upkeep:
            self.upkeep_ns += ns

    def upkept(self, shadows: int) -> None:
        """The shadows this step's upkeep was for."""
        self.upkeep_shadows = max(self.upkeep_shadows, shadows)

    def wants_fill_sample(self) -> bool:
        """Time one shadow's row fill at this walking step?"""
        return self.walked and self.walked_steps % FILL_SAMPLE_EVERY == 1

    def fill_sample(self, ns: float) -> None:
        self.fill_samples.append(float(ns))
        self.row_fill_ns = statistics.median_low(self.fill_samples)

    def observe(self, batch_requests: int, gain: float,
                extra_rows: float = 0, row_factor: float = 1.0,
                row_ns: float | None = None) -> None:
        """At a step's advance: what the previous step's drafting cost (its
        rows: those `decide` was asked about) and gained (`gain`: the sum of
        the walked requests' speed-ups, g / (t - g) each, counted by the
        caller); `batch_requests`: the batch's requests that committed
        tokens; `extra_rows`: the verification rows its drafts added to
        the scheduler's walk, against the rows stock would have filled;
        `row_factor`: what such a row costs the engine thread as a share of
        a serial row fill (the scheduler's threaded walk, measured there);
        `row_ns`: what a row cost the scheduler's engine thread on its own
        last walks, where this process can read it (then the price of a
        row, instead of a shadow's fill times `row_factor`)."""
        self.step += 1
        self.row_factor = min(1.0, max(0.0, row_factor))
        # What the feature added to the step: its host time (walk and
        # upkeep), the verification rows its drafts added, the syncs.
        if row_ns is not None:
            self.scheduler_row_ns = float(row_ns)
        price = self.scheduler_row_ns if self.scheduler_row_ns is not None \
            else (self.row_fill_ns or 0.0) * self.row_factor
        rows_ns = extra_rows * price
        added = self.host_ns + rows_ns
        if self.walked:
            added += (self.positions + 1) * self.sync_ns
        now = time.perf_counter_ns()
        if self.last_step_at is not None:
            # The step as stock would have taken it: its cost is relative to
            # that, not to a step it made longer itself (a walk adding 48 ms
            # to a 69 ms step is +70 %, not 48 of 117 ms).
            interval = float(now - self.last_step_at)
            self.step_ns = _median(self.step_samples,
                                   max(interval - added, 0.1 * interval),
                                   low=True)
        self.last_step_at = now
        if batch_requests > 0:
            self.requests_per_step = _median(self.request_samples,
                                             float(batch_requests), low=False)
        if self.rows > 0 and self.walked:
            upkeep = min(self.upkeep_ns, self.host_ns)
            walk = self.host_ns - upkeep + rows_ns
            shadows = max(self.upkeep_shadows, self.rows)
            self.walk_points.append((self.rows, float(walk)))
            self.upkeep_samples.append(upkeep / shadows)
            self.cost_per_row_ns = self.row_price(
                max(self.batch_rows, self.rows))
            # The prior is one step's worth until the window is full: not
            # seeded by the first step (whose gain may be nothing: the
            # batch's first drafts), not outweighing what is measured.
            self.gain_samples.append(gain / self.rows)
            prior = [] if len(self.gain_samples) == GAIN_WINDOW \
                else [PRIOR_GAIN_PER_ROW]
            self.gain_per_row = statistics.fmean([*prior, *self.gain_samples])
        self.host_ns = self.rows = 0
        self.upkeep_ns = self.upkeep_shadows = 0
        self.walked = False

    # -- decisions ---------------------------------------------------------
    def dormant(self) -> bool:
        """No shadows at all for now (a cheap check, once per step: while
        dormant it counts the steps towards re-arming)."""
        if self.regime != "dormant":
            return False
        self.step += 1
        if self.step < self.rearm_at:
            return True
        self.regime, self.off_run = "on", 0
        # The time since the last step measured is not a step's.
        self.last_step_at = None
        logger.info("vllm_patch: grammar-aware drafting re-armed for new "
                    "structured requests (last measured speed-up of a walked "
                    "request %.0f%%)", 100 * (self.gain_per_row or 0.0))
        return False

    def row_price(self, rows: int) -> float:
        """What walking `rows` rows costs per row (ns): as measured where
        two walks had half to twice as many rows, else the walk's line
        (fixed part over the rows, plus the part per row), else the low
        median of the walks' costs per row; plus the upkeep per shadow."""
        upkeep = statistics.median_low(self.upkeep_samples) \
            if self.upkeep_samples else 0.0
        if not self.walk_points:
            return upkeep
        near = [n / r for r, n in self.walk_points
                if rows <= 2 * r <= 4 * rows]
        line = None if len(near) >= 2 else _walk_line(self.walk_points)
        if line is not None:
            fixed, per_row = line
            walk = fixed / max(rows, 1) + per_row
        else:
            walk = statistics.median_low(
                near if len(near) >= 2
                else [n / r for r, n in self.walk_points])
        return walk + upkeep

    def measuring(self, rows: int) -> bool:
        """Not measured enough to decide for a batch of `rows` rows yet:
        two walking steps, four where the batch is sampled in two sizes
        (two of each: one one-off among them never decides)."""
        need = 4 if rows >= 2 * SAMPLE_ROWS else 2
        return self.step_ns is None or self.requests_per_step is None \
            or len(self.walk_points) < need

    def expected(self, rows: int, positions: int) -> tuple[float, float]:
        """(relative gain in output speed, relative cost in step time)."""
        if self.measuring(rows):
            return 1.0, 0.0  # not measured twice yet: run, and measure
        per_row = PRIOR_GAIN_PER_ROW if self.gain_per_row is None \
            else self.gain_per_row
        gain = rows * per_row / max(self.requests_per_step, 1.0)
        # The synchronisations: one per draft position, and the read of the
        # step's sampled tokens the shadows advance by.
        cost = (rows * self.row_price(rows)
                + (positions + 1) * self.sync_ns) / max(self.step_ns, 1.0)
        return gain, cost

    def decide(self, rows: int, positions: int) -> int:
        """How many of this step's `rows` walk the grammar: all of them, a
        sample (`SAMPLE_ROWS` or `LARGE_SAMPLE_ROWS` at most, in turn:
        measuring, probing) or none."""
        self.batch_rows, self.positions = rows, positions
        if not self.enabled:
            self.rows = rows
            self.walked = True
            self.counts["steps_on"] += 1
            return rows
        measuring = self.measuring(rows)
        gain, cost = self.expected(rows, positions)
        on = gain > DECISION_MARGIN * cost
        probe = not on and self.regime == "off" \
            and (self.off_run + 1) % OFF_PROBE_EVERY == 0
        if on:
            self.off_run = 0
            self.counts["steps_on"] += 1
            if self.regime != "on":
                logger.info("vllm_patch: grammar-aware drafting on again: "
                            "expected gain %.1f%% in output speed, cost "
                            "%.1f%% of the step's time", 100 * gain,
                            100 * cost)
            self.regime = "on"
        else:
            self.off_run += 1
            self.counts["steps_off"] += 1
            if self.regime == "on":
                logger.info("vllm_patch: grammar-aware drafting off for this "
                            "batch: expected gain %.1f%% in output speed, "
                            "cost %.1f%% of the step's time", 100 * gain,
                            100 * cost)
            self.regime = "off"
            if self.off_run >= DORMANT_AFTER:
                self.go_dormant()
                probe = False
            elif probe:
                self.counts["steps_probed"] += 1
        self.walked = on or probe
        walk = 0
        if self.walked:
            self.walked_steps += 1
            walk = rows
            if measuring or not on:
                walk = min(rows, LARGE_SAMPLE_ROWS if self.samples_taken % 2
                           else SAMPLE_ROWS)
                if rows > SAMPLE_ROWS:
                    self.samples_taken += 1
            if walk < rows:
                self.counts["steps_sampled"] += 1
        self.rows = walk
        return walk

    def sample(self, rows: list, walk: int) -> list:
        """`walk` of `rows` (all of them, or a window that rotates over the
        rows from one sampled step to the next)."""
        if walk >= len(rows):
            return rows
        start = self.sample_at % len(rows)
        self.sample_at = start + walk
        return (rows[start:] + rows[:start])[:walk]

    def go_dormant(self) -> None:
        self.regime = "dormant"
        self.rearm_at = self.step + self.backoff
        self.counts["dormant_periods"] += 1
        logger.info("vllm_patch: grammar-aware drafting dormant for %d steps "
                    "(it did not pay for %d steps in a row); requests in "
                    "flight draft as in stock vLLM", self.backoff, self.off_run)
        self.backoff = min(2 * self.backoff, BACKOFF_MAX)

    def snapshot(self) -> dict[str, object]:
        return {"regime": self.regime, **self.counts,
                "gain_per_row": None if self.gain_per_row is None
                else round(self.gain_per_row, 3),
                "cost_per_row_us": None if self.cost_per_row_ns is None
                else round(self.cost_per_row_ns / 1e3, 1),
                "row_fill_us": None if self.row_fill_ns is None
                else round(self.row_fill_ns / 1e3, 1),
                "scheduler_row_us": None if self.scheduler_row_ns is None
                else round(self.scheduler_row_ns / 1e3, 1),
                "row_factor": round(self.row_factor, 3),
                "step_ms": None if self.step_ns is None
                else round(self.step_ns / 1e6, 2)}


# The forced continuation's and the drafter's verdicts: priors (hits,
# trials) and the per-step decay (half-life about 140 steps).
PRIOR_FORCED = (2.0, 2.0)
PRIOR_MODEL = (1.0, 2.0)
VERDICT_DECAY = 0.995
# While the continuation yields to the drafter: every this many steps it
# is still computed (not drafted) and judged against what the target took.
PROBE_EVERY = 8


@dataclass
class ForcedAheadChoice:
    """Does the grammar's forced continuation fill a structured request's
    first draft slots ahead of a model drafter (EAGLE, draft model, MTP)?

    The continuation is the text the grammar forces, in the tokenizer's
    canonical spelling; a model may spell the same text with other tokens
    (the grammar allows them all), and a good drafter spells it as the
    target will. So both sources are judged by the target, position by
    position, on the worker: the continuation's token at draft position j
    is a hit if the target took it after the same prefix; the drafter's
    drafts hit up to the first one the target rejected. The continuation
    drafts while its rate of hits is at least the drafter's; otherwise it
    yields (the drafter's masked drafts fill the slots) and is still
    computed, not drafted, every `PROBE_EVERY` steps, so that it comes
    back where the target keeps taking it. Exact for greedy targets; for
    sampled ones an estimate of the same rates.
    """

    # False (VLLM_PATCH_DRAFT_COST_MODEL=0): always drafted.
    enabled: bool = True
    forced_hits: float = PRIOR_FORCED[0]
    forced_trials: float = PRIOR_FORCED[1]
    model_hits: float = PRIOR_MODEL[0]
    model_trials: float = PRIOR_MODEL[1]
    drafting: bool = True
    steps_yielded: int = 0

    def rates(self) -> tuple[float, float]:
        return (self.forced_hits / self.forced_trials,
                self.model_hits / self.model_trials)

    def mode(self) -> str:
        """At a step's drafting: 'draft' (the continuation fills the first
        slots), 'probe' (computed and judged, not drafted) or 'skip'."""
        forced, model = self.rates()
        drafting = forced >= model or not self.enabled
        if drafting != self.drafting:
            self.drafting = drafting
            logger.info(
                "vllm_patch: forced continuation %s the model's drafts: the "
                "target took %.0f%% of its tokens, %.0f%% of the drafter's",
                "drafted ahead of" if drafting else "yields to",
                100 * forced, 100 * model)
        if drafting:
            self.steps_yielded = 0
            return "draft"
        self.steps_yielded += 1
        return "probe" if self.steps_yielded % PROBE_EVERY == 1 else "skip"

    def tick(self) -> None:
        """Once per step, before its verdicts: older verdicts weigh less."""
        for name in ("forced_hits", "forced_trials", "model_hits",
                     "model_trials"):
            setattr(self, name, getattr(self, name) * VERDICT_DECAY)
        # The priors' trials never decay below a floor (no division by 0).
        self.forced_trials = max(self.forced_trials, 1e-3)
        self.model_trials = max(self.model_trials, 1e-3)

    def judge(self, forced: list[int], drafted: bool, drafts: int,
              tokens: list[int]) -> None:
        """One request's verdicts for the last drafting step: `forced` its
        continuation then (drafted in its first slots or only computed),
        `drafts` the drafts handed over, `tokens` what this step committed
        for it (the accepted drafts, then the target's own token)."""
        for j, token in enumerate(forced):
            if j >= len(tokens):
                break
            self.forced_trials += 1
            if tokens[j] != token:
                break
            self.forced_hits += 1
        accepted = len(tokens) - 1
        for j in range(len(forced) if drafted else 0, drafts):
            if j > accepted:
                break
            self.model_trials += 1
            if j == accepted:
                break
            self.model_hits += 1

    def snapshot(self) -> dict[str, object]:
        forced, model = self.rates()
        return {"drafting": int(self.drafting),
                "forced_hit_rate": round(forced, 3),
                "model_hit_rate": round(model, 3)}
