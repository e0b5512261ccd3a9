"""Grammar-aware drafting's cost model (vllm_patch.v1.spec_decode.draft_cost):
a batch walks its grammars only while the measured gain in output speed
beats 1.15 times the measured cost in step time; a feature that keeps not
paying goes dormant (no cost at all) and re-arms after a back-off.

A feature of the package with no stock counterpart (marker patched_only):
the stock run has nothing to show."""

from __future__ import annotations

import pytest

from vllm_patch.v1.spec_decode import draft_cost as dc

pytestmark = [pytest.mark.unit, pytest.mark.patched_only]


class Clock:
    def __init__(self, monkeypatch) -> None:
        self.now = 0
        monkeypatch.setattr(dc.time, "perf_counter_ns", lambda: self.now)


def _steps(cost: dc.DraftCost, clock: Clock, n: int, *, step_ms: float,
           requests: int, rows: int, host_us_per_row: float,
           speedup: float, extra_rows_per_row: float = 0.0,
           row_factor: float = 1.0, host_us_fixed: float = 0.0,
           row_ns: float | None = None, true_row_ns: float | None = None,
           ) -> list[int]:
    """n steps of a batch of `requests` requests, `rows` of them structured,
    each `step_ms` in stock: decide, spend host time on the rows that walk
    (and `host_us_fixed` on a step that walks any, whatever their number),
    which the step takes on top, then observe; `speedup`:
    what walking does for a walked request, g / (t - g) (a request that
    commits 2 tokens a step in stock and 1 more walked: 0.5);
    `extra_rows_per_row`: verification rows the walk adds per walked row;
    `true_row_ns`: what such a row costs the step (default: a shadow's
    fill times `row_factor`); `row_ns`: the scheduler's own row price the
    model is told. Returns the rows walked per step (0: none)."""
    out = []
    for _ in range(n):
        if cost.dormant():
            out.append(0)
            clock.now += int(step_ms * 1e6)
            continue
        walked = cost.decide(rows, 4)
        out.append(walked)
        host = int(walked * host_us_per_row * 1e3)
        if walked:
            host += int(host_us_fixed * 1e3)
        cost.host_ns += host
        # The step takes stock's time plus what the walk added to it: its
        # host time, its verification rows, its syncs (one per position and
        # the token read).
        price = true_row_ns if true_row_ns is not None \
            else (cost.row_fill_ns or 0.0) * row_factor
        extra = walked * extra_rows_per_row * price \
            + (5 * cost.sync_ns if walked else 0.0)
        clock.now += int(step_ms * 1e6 + host + extra)
        cost.observe(requests, walked * speedup,
                     int(round(walked * extra_rows_per_row)), row_factor,
                     row_ns=row_ns)
    return out


def test_runs_until_measured(monkeypatch):
    cost = dc.DraftCost(enabled=True, sync_ns=0.0)
    assert cost.expected(10, 4) == (1.0, 0.0)
    assert cost.decide(10, 4) and cost.regime == "on"


def test_on_where_gain_beats_cost(monkeypatch):
    """B=256 structured rows, 2 tokens per row per step, +1 per row from the
    walk (+50 %), 10 us of host time per row in a 20 ms step (+13 %): on."""
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=True, sync_ns=30e3)
    on = _steps(cost, clock, 50, step_ms=20, requests=256, rows=256,
                host_us_per_row=10, speedup=0.5)
    assert all(on) and cost.regime == "on"
    gain, c = cost.expected(256, 4)
    assert gain == pytest.approx(0.5, rel=0.05) and c < gain


def test_off_then_dormant_then_rearmed(monkeypatch):
    """One structured row in a batch of 256 whose drafter already agrees
    with the grammar (no gain) on a fast GPU step: the syncs alone cost
    more than it gains, so it turns off, goes dormant, re-arms later."""
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=True, sync_ns=30e3)
    on = _steps(cost, clock, 3, step_ms=10, requests=256, rows=1,
                host_us_per_row=5, speedup=0)
    assert on[0]  # measured first
    on += _steps(cost, clock, dc.DORMANT_AFTER + 5, step_ms=10, requests=256,
                 rows=1, host_us_per_row=5, speedup=0)
    # Off from the second step: only the probes walk (every OFF_PROBE_EVERY-th
    # step in a row that is off), then dormant.
    first_off = on.index(False)
    walked_off = [i - first_off + 1 for i, x in enumerate(on)
                  if x and i > first_off]
    assert first_off <= 2 and walked_off and \
        all(n % dc.OFF_PROBE_EVERY == 0 for n in walked_off)
    assert cost.counts["steps_probed"] == len(walked_off)
    assert cost.regime == "dormant"
    assert cost.counts["dormant_periods"] == 1
    first_rearm = cost.rearm_at
    while cost.dormant():
        clock.now += 10**7
    assert cost.step == first_rearm and cost.regime == "on"
    assert cost.backoff == 2 * dc.BACKOFF_FIRST  # longer next time
    # Still nothing to gain: dormant again, for twice as long.
    _steps(cost, clock, dc.DORMANT_AFTER + 2, step_ms=10, requests=256, rows=1,
           host_us_per_row=5, speedup=0)
    assert cost.regime == "dormant" and cost.counts["dormant_periods"] == 2
    assert cost.rearm_at - first_rearm >= 2 * dc.BACKOFF_FIRST
    assert cost.backoff == 4 * dc.BACKOFF_FIRST


def test_first_steps_without_gain_do_not_turn_it_off(monkeypatch):
    """A batch's first drafting steps often gain nothing (its requests just
    left their prefills): one batch row, 2 tokens per step, 5 us of host
    time in a 20 ms step; then walking gains 1.5 tokens per step (1.75x as
    fast). The gain
    starts from the prior and is averaged, not seeded by the first step."""
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=True, sync_ns=0.0)
    on = _steps(cost, clock, 3, step_ms=20, requests=1, rows=1,
                host_us_per_row=5, speedup=0)
    on += _steps(cost, clock, 40, step_ms=20, requests=1, rows=1,
                 host_us_per_row=5, speedup=0.75)
    assert all(on) and cost.regime == "on"


def test_a_one_off_first_step_does_not_turn_it_off(monkeypatch):
    """One batch row where the walk pays (+1 token per row and step, 2 per
    step, 50 us of host time in a 20 ms step), but the first walking step
    pays a one-off 100 ms (warm-up: a first call's allocations, a cache
    fill): one sample among several, it never decides alone. (An average
    seeded by it judged the walk to cost 5 steps' time: off, then dormant
    for the rest of the requests' lives.)"""
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=True, sync_ns=0.0)
    on = _steps(cost, clock, 1, step_ms=20, requests=1, rows=1,
                host_us_per_row=100_000, speedup=0.5)
    on += _steps(cost, clock, 40, step_ms=20, requests=1, rows=1,
                 host_us_per_row=50, speedup=0.5)
    assert all(on) and cost.regime == "on"
    assert cost.counts["dormant_periods"] == 0


def test_gain_measured_within_a_few_steps(monkeypatch):
    """B=256 rows, 2 tokens per row and step; the walk gains 0.2 tokens per
    row (+10 %) and costs 30 % of the step (300 us per row host time in a
    256 ms step): it must stop within a few steps, not after the many an
    average decaying from the prior of 1 token per row needs."""
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=True, sync_ns=0.0)
    on = _steps(cost, clock, dc.OFF_PROBE_EVERY + 4, step_ms=256, requests=256,
                rows=256, host_us_per_row=300, speedup=0.1)
    # The first four walking steps measure (two samples of each size); then
    # off (a probe at most).
    assert all(on[:4]) and not any(on[4:4 + dc.OFF_PROBE_EVERY - 1])
    assert cost.regime in ("off", "dormant")


def test_probe_brings_it_back(monkeypatch):
    """Off after a long stretch without gain; the requests then reach text
    the drafter gets wrong (the walk gains 3 tokens per row): a probe
    measures it and the batch walks again before going dormant."""
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=True, sync_ns=30e3)
    for _ in range(100):  # the averaged gain decays from the prior
        if not _steps(cost, clock, 1, step_ms=20, requests=8, rows=8,
                      host_us_per_row=50, speedup=0)[0]:
            break
    _steps(cost, clock, 1, step_ms=20, requests=8, rows=8,
           host_us_per_row=50, speedup=0)
    assert cost.regime == "off" and cost.off_run == 2
    on = _steps(cost, clock, dc.DORMANT_AFTER - 3, step_ms=20, requests=8,
                rows=8, host_us_per_row=50, speedup=1.5)
    assert cost.regime == "on" and on[-1] and cost.counts["dormant_periods"] == 0


def test_verification_rows_are_charged(monkeypatch):
    """B=256, cheap hooks (2 us per row in a 20 ms step), +0.2 tokens per
    row (+10 %): on, until the scheduler's work is priced in: the walk's
    drafts are all grammar-valid, 2 more verification rows per request
    than stock's cut drafts, 50 us a row fill: off."""
    clock = Clock(monkeypatch)
    cheap = dc.DraftCost(enabled=True, sync_ns=0.0)
    assert all(_steps(cheap, clock, 40, step_ms=20, requests=256, rows=256,
                      host_us_per_row=2, speedup=0.1,
                      extra_rows_per_row=2.0))
    priced = dc.DraftCost(enabled=True, sync_ns=0.0)
    priced.fill_sample(50e3)
    on = _steps(priced, clock, 40, step_ms=20, requests=256, rows=256,
                host_us_per_row=2, speedup=0.1, extra_rows_per_row=2.0)
    assert on[0] and not on[-1] and priced.regime in ("off", "dormant")


def test_threaded_verification_rows_are_charged_at_their_share(monkeypatch):
    """B=256, cheap hooks (2 us per row in a 20 ms step), +0.2 tokens per
    row (+10 %), half a verification row more per request at 20 us a
    fill: priced as serial fills, +15 % step time, off. Where the
    scheduler walks its rows on vLLM's fill threads and measured a row
    there at 0.3 of a serial one: +6.4 %, on."""
    clock = Clock(monkeypatch)
    threaded = dc.DraftCost(enabled=True, sync_ns=0.0)
    threaded.fill_sample(20e3)
    on = _steps(threaded, clock, 40, step_ms=20, requests=256, rows=256,
                host_us_per_row=2, speedup=0.1, extra_rows_per_row=0.5,
                row_factor=0.3)
    assert all(on) and threaded.regime == "on"
    assert threaded.snapshot()["row_factor"] == 0.3
    gain, cost = threaded.expected(256, 4)
    assert cost < gain
    serial = dc.DraftCost(enabled=True, sync_ns=0.0)
    serial.fill_sample(20e3)
    on = _steps(serial, clock, 40, step_ms=20, requests=256, rows=256,
                host_us_per_row=2, speedup=0.1, extra_rows_per_row=0.5)
    assert not on[-1] and serial.regime in ("off", "dormant")


def test_rows_priced_at_the_schedulers_own_walk(monkeypatch):
    """Where the scheduler's own walks priced a row (in-process), its added
    rows cost that, not a shadow's fill: B=256, +50 % for the walked
    requests, 5 us of host time per row, one added row each; a shadow's
    fill reads 5 us but the scheduler's rows cost 60 us (written into its
    batch's bitmask: +83 % of a 20 ms step). Told the scheduler's price,
    the model stops walking; priced at the fill it walks and loses."""
    told = dc.DraftCost(enabled=True, sync_ns=0.0)
    told.fill_sample(5e3)
    on = _steps(told, Clock(monkeypatch), 40, step_ms=20, requests=256,
                rows=256, host_us_per_row=5, speedup=0.5,
                extra_rows_per_row=1.0, true_row_ns=60e3, row_ns=60e3)
    assert told.snapshot()["scheduler_row_us"] == 60.0
    assert not on[-1] and told.regime in ("off", "dormant")
    blind = dc.DraftCost(enabled=True, sync_ns=0.0)
    blind.fill_sample(5e3)
    on = _steps(blind, Clock(monkeypatch), 40, step_ms=20, requests=256,
                rows=256, host_us_per_row=5, speedup=0.5,
                extra_rows_per_row=1.0, true_row_ns=60e3)
    assert all(on) and blind.regime == "on"


def test_row_fill_sampled_on_walking_steps():
    cost = dc.DraftCost(enabled=True, sync_ns=0.0)
    sampled = []
    for _ in range(40):
        cost.decide(4, 4)
        sampled.append(cost.wants_fill_sample())
        cost.observe(4, 2.0)
    assert sampled.count(True) == len(range(1, 41, dc.FILL_SAMPLE_EVERY))


def test_a_large_batch_measures_and_probes_on_a_sample(monkeypatch):
    """B=256 where the walk does not pay (0.2 tokens per row, +10 %, for
    300 us of host time per row in a 256 ms step, +30 %): the measuring
    steps and the probes walk SAMPLE_ROWS and LARGE_SAMPLE_ROWS rows in
    turn, a window that moves over the batch; no step walks every row
    before it goes dormant."""
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=True, sync_ns=0.0)
    walked = _steps(cost, clock, dc.DORMANT_AFTER + 4, step_ms=256,
                    requests=256, rows=256, host_us_per_row=300,
                    speedup=0.1)
    assert cost.regime == "dormant"
    assert walked[:4] == [dc.SAMPLE_ROWS, dc.LARGE_SAMPLE_ROWS] * 2
    sampled = [w for w in walked if w]
    assert set(sampled) == {dc.SAMPLE_ROWS, dc.LARGE_SAMPLE_ROWS}
    assert len(sampled) >= 3 and cost.counts["steps_sampled"] == len(sampled)
    # In turn: the small and the large sample.
    assert sampled[::2] == [dc.SAMPLE_ROWS] * len(sampled[::2])
    assert sampled[1::2] == [dc.LARGE_SAMPLE_ROWS] * len(sampled[1::2])
    rows = list(range(256))
    first, second = cost.sample(rows, 16), cost.sample(rows, 16)
    assert len(first) == len(second) == 16 and not set(first) & set(second)
    # A small batch walks whole (a sample of it would be all of it anyway).
    small = dc.DraftCost(enabled=True, sync_ns=0.0)
    assert small.decide(8, 4) == 8 and small.sample(list(range(8)), 8) == \
        list(range(8))


def test_a_sample_that_pays_turns_the_whole_batch_on(monkeypatch):
    """B=64 where the walk pays (+1 token per row and step on 2, 10 us per
    row in a 20 ms step): measured on a sample, then every row walks."""
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=True, sync_ns=0.0)
    walked = _steps(cost, clock, 10, step_ms=20, requests=64, rows=64,
                    host_us_per_row=10, speedup=0.5)
    # The large sample of a batch of 64 is all of it.
    assert walked[:4] == [dc.SAMPLE_ROWS, 64] * 2 and walked[4:] == [64] * 6
    assert cost.regime == "on"


def test_upkeep_priced_per_shadow_walk_per_walked_row(monkeypatch):
    """A sampled step: 16 rows walk for 1.6 ms, the upkeep of 256 shadows
    costs 2.56 ms; per row: 100 us walking + 10 us upkeep (not 260 us: the
    upkeep of the whole batch charged to the sample)."""
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=True, sync_ns=0.0)
    cost.observe(256, 0)
    assert cost.decide(256, 4) == dc.SAMPLE_ROWS
    cost.host_ns += 1_600_000
    t0 = dc.time.thread_time_ns()
    cost.charge(t0, upkeep=True)
    cost.host_ns += 2_560_000
    cost.upkeep_ns += 2_560_000
    cost.upkept(256)
    clock.now += 20 * 10**6
    cost.observe(256, 0)
    assert cost.walk_points[-1] == (dc.SAMPLE_ROWS, 1_600_000)
    assert cost.upkeep_samples[-1] == pytest.approx(10e3, rel=0.01)
    assert cost.cost_per_row_ns == pytest.approx(110e3, rel=0.01)


def test_fixed_work_per_step_told_apart_from_the_work_per_row(monkeypatch):
    """A walking step costs 2 ms whatever its rows (the drafts' write-back,
    one batched grammar call per position) plus 10 us per walked row. B=256
    in 20 ms steps, each walked request 1.35x as fast (+35 %): walking every
    row costs 4.56 ms (+23 %), so it pays, also with the decision's margin.
    Priced per row of a 16-row sample (135 us) the batch would cost 35 ms
    (+173 %): off. The
    samples of two sizes tell the fixed part from the rows': on, and the
    price it then measures walking every row is what the line said."""
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=True, sync_ns=0.0)
    walked = _steps(cost, clock, 12, step_ms=20, requests=256, rows=256,
                    host_us_per_row=10, host_us_fixed=2000, speedup=0.35)
    assert walked[:4] == [dc.SAMPLE_ROWS, dc.LARGE_SAMPLE_ROWS] * 2
    assert walked[4:] == [256] * 8 and cost.regime == "on"
    assert cost.row_price(256) == pytest.approx(2000e3 / 256 + 10e3, rel=0.01)
    gain, c = cost.expected(256, 4)
    assert c == pytest.approx(4.56 / 20, rel=0.02) and c < gain
    # A sample's own cost per row is still what it cost (a batch of 16).
    assert cost.row_price(16) == pytest.approx(2000e3 / 16 + 10e3, rel=0.01)


def test_fixed_work_per_step_that_does_not_pay(monkeypatch):
    """The same walk (2 ms a step + 10 us per row) for +0.15 tokens per row
    (+7.5 %) against +23 %: off, then dormant; no step walks every row."""
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=True, sync_ns=0.0)
    walked = _steps(cost, clock, 20, step_ms=20, requests=256, rows=256,
                    host_us_per_row=10, host_us_fixed=2000, speedup=0.075)
    assert max(walked) <= dc.LARGE_SAMPLE_ROWS and cost.regime == "dormant"


def test_a_one_off_sample_does_not_decide(monkeypatch):
    """The walk of the previous test, which pays, where the first sample of
    each size paid a one-off 100 ms (warm-up): each size's cost is the low
    median of its samples, so the batch still walks every row."""
    clock = Clock(monkeypatch)
    for slow in (0, 1):
        cost = dc.DraftCost(enabled=True, sync_ns=0.0)
        walked = []
        for i in range(12):
            walked += _steps(cost, clock, 1, step_ms=20, requests=256, rows=256,
                             host_us_per_row=10, speedup=0.35,
                             host_us_fixed=2000 + (100_000 if i == slow else 0))
        assert walked[4:] == [256] * 8 and cost.regime == "on", (slow, walked)


@pytest.mark.parametrize("speedup,walks", [(0.6, False), (2.0, True)])
def test_cost_relative_to_the_step_stock_would_take(monkeypatch, speedup,
                                                    walks):
    """A walk that adds 20 ms to a 20 ms step doubles it (+100 %): a
    request 1.6x as fast does not pay for it, 3x as fast does (beyond the
    decision's margin). Relative
    to the step it made 40 ms long itself the walk would read +50 %, and
    a batch 1.6x as fast would walk (and lose 20 %)."""
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=True, sync_ns=0.0)
    walked = _steps(cost, clock, 20, step_ms=20, requests=8, rows=8,
                    host_us_per_row=2500, speedup=speedup)
    assert cost.step_ns == pytest.approx(20e6, rel=0.01)
    gain, c = cost.expected(8, 4)
    assert c == pytest.approx(1.0, rel=0.02)
    if walks:
        assert all(walked) and cost.regime == "on"
    else:
        # Measured twice, then off (the probes walk) and dormant.
        assert cost.regime == "dormant" and walked.count(8) <= \
            2 + dc.DORMANT_AFTER // dc.OFF_PROBE_EVERY, walked


@pytest.mark.parametrize("speedup,walks", [(0.22, False), (0.3, True)])
def test_the_walk_must_gain_a_margin_over_its_cost(monkeypatch, speedup,
                                                   walks):
    """The walk adds 4 ms to a 20 ms step (+20 %). A request 1.22x as fast
    (1.1 times the cost) is within the decision's margin (what the measured
    cost leaves out): stock's drafts. 1.3x as fast (1.5 times): it walks."""
    assert dc.DECISION_MARGIN == 1.15
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=True, sync_ns=0.0)
    walked = _steps(cost, clock, 40, step_ms=20, requests=8, rows=8,
                    host_us_per_row=500, speedup=speedup)
    assert cost.regime == ("on" if walks else "dormant"), walked
    assert all(walked[-8:]) if walks else not any(walked[-8:])


def test_a_slow_first_step_does_not_make_the_walk_look_cheap(monkeypatch):
    """B=256 in 20 ms steps where the walk does not pay (0.2 tokens per row
    on 2, 200 us per row: +10 % tokens for +250 % time); the batch's first
    step took 600 ms (it built 256 shadows). Measured on a sample, then off:
    no step walks the whole batch (an average seeded by the first step time
    read the walk as 30 times cheaper and walked every row for 10 steps)."""
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=True, sync_ns=0.0)
    cost.observe(0, 0)  # the step before: the clock starts
    _steps(cost, clock, 1, step_ms=600, requests=128, rows=256,
           host_us_per_row=200, speedup=0.1)
    walked = _steps(cost, clock, 16, step_ms=20, requests=256, rows=256,
                    host_us_per_row=200, speedup=0.1)
    assert max(walked) <= dc.LARGE_SAMPLE_ROWS
    assert cost.regime == "dormant"


def test_disabled_model_always_walks(monkeypatch):
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=False, sync_ns=30e3)
    on = _steps(cost, clock, 40, step_ms=10, requests=256, rows=1,
                host_us_per_row=5, speedup=0)
    assert all(on) and cost.regime == "on"


def _verdicts(choice: dc.ForcedAheadChoice, steps: int, *, target_takes_forced: bool,
              drafter_takes_forced: bool = False, forced=(11, 12), own=(21, 22),
              k: int = 4) -> list[str]:
    """Steps of one request at a forced text: the continuation spells it
    as `forced`, the drafter as `forced` or `own`, the target as `forced`
    or `own`; after it the drafter drafts what the target takes."""
    modes = []
    rest = [30, 31, 32]
    target = list(forced if target_takes_forced else own) + rest
    drafter = list(forced if drafter_takes_forced else own) + rest
    for _ in range(steps):
        mode = choice.mode()
        modes.append(mode)
        choice.tick()
        drafted = mode == "draft"
        drafts = (list(forced) + drafter[len(forced):] if drafted else drafter)[:k]
        accepted = next((j for j in range(k) if drafts[j] != target[j]), k)
        choice.judge(list(forced) if mode != "skip" else [], drafted, k,
                     target[:accepted + 1])
    return modes


def test_forced_continuation_yields_to_a_drafter_the_target_agrees_with():
    choice = dc.ForcedAheadChoice()
    modes = _verdicts(choice, 40, target_takes_forced=False)
    assert modes[0] == "draft"  # before any verdict: the continuation drafts
    assert modes[1:].count("draft") <= 2, modes
    # Yielding, it is still judged now and then (probe), and stays yielded.
    assert "probe" in modes and modes[-8:].count("draft") == 0, modes
    forced_rate, model_rate = choice.rates()
    assert forced_rate < 0.5 < model_rate, choice.snapshot()


def test_forced_continuation_drafts_where_the_target_takes_it():
    choice = dc.ForcedAheadChoice()
    assert set(_verdicts(choice, 40, target_takes_forced=True)) == {"draft"}


def test_forced_continuation_comes_back_when_the_target_takes_it_again():
    choice = dc.ForcedAheadChoice()
    _verdicts(choice, 40, target_takes_forced=False)
    # Now the target spells the forced text as the continuation does and the
    # drafter does not: the probes see it and the continuation drafts again.
    modes = _verdicts(choice, 200, target_takes_forced=True,
                      drafter_takes_forced=False)
    assert modes[-50:] == ["draft"] * 50, modes


def test_forced_continuation_always_drafts_without_the_cost_model():
    choice = dc.ForcedAheadChoice(enabled=False)
    assert set(_verdicts(choice, 20, target_takes_forced=False)) == {"draft"}


def test_syncs_priced_per_position_and_for_the_token_read(monkeypatch):
    """On a GPU host each draft position the walk masks waits for the device
    once, and the shadows' advance reads the step's sampled tokens once: at
    30 us a sync in a 10 ms step, 4 positions cost 5 syncs (1.5 % of the
    step) beside the rows' host time."""
    clock = Clock(monkeypatch)
    cost = dc.DraftCost(enabled=True, sync_ns=30e3)
    _steps(cost, clock, 3, step_ms=10, requests=256, rows=16,
           host_us_per_row=5, speedup=0.5)
    _, c = cost.expected(16, 4)
    assert c == pytest.approx((16 * cost.cost_per_row_ns + 5 * 30e3) / 10e6)
