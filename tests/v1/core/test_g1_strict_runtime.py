"""G1 runtime strictness (VLLM_PATCH_STRICT_RUNTIME=1), scheduler tier.

Strictness raises only when stale grammar state would be used despite G1's
mechanism (its safety net: a bitmask built, or drafts validated, while an
earlier step of the request is unapplied). vLLM's own engine flows that need
the mechanism (a PP decode stagger below the pipeline depth; a sync scheduler
with a batch queue and drafts) run clean under it: no exception, every
bitmask row and validated draft list current, grammar-valid output, and the
mechanism's counters show it did its work. Something that bypasses the
mechanism (a custom scheduler or engine loop) raises StaleGrammarError.

Stock (VLLM_PATCH_DISABLE=1), the same flows show the stale use the
mechanism removes, and nothing raises.
"""

from __future__ import annotations

import logging
import re

import pytest

from vllm_patch.conformance import g1
from vllm_patch.v1.core.sched.scheduler import g1_inflight as inflight

pytestmark = [pytest.mark.scheduler, pytest.mark.usefixtures("plugin_g1")]

MAX_TOKENS = 12


# -------------------------------------------------------------------- flows
def _pp_stagger(depth: int, stagger: int, spec: int = 0):
    """Gap 1: async scheduler, batch queue `depth` (pipeline depth + 1), a
    decode stagger below the pipeline depth (the conformance scenario's
    flow, keeping the harness)."""
    h = g1.harness(async_scheduling=True, num_spec_tokens=spec)
    h.scheduler.use_v2_model_runner = True
    h.scheduler.decode_stagger = stagger
    h.engine_setup(depth, g1.sampler, g1.drafter if spec else None)
    h.add_request([h.tok(c) for c in "xyzx"], max_tokens=14)  # plain
    h.engine_step()
    rids = g1.add_requests(h, 2, max_tokens=MAX_TOKENS)
    return h, rids, 12


def _sync_batch_queue():
    """Gap 2: sync Scheduler, batch queue 2 (PP without async), 3 drafts."""
    h = g1.harness(async_scheduling=False, num_spec_tokens=3)
    h.engine_setup(2, g1.sampler, g1.drafter)
    rids = g1.add_requests(h, 1, max_tokens=MAX_TOKENS)
    return h, rids, 10


FLOWS = {
    # name: (build, the kind of work the mechanism must do there)
    "pp-stagger1-queue3": (lambda: _pp_stagger(3, 1), inflight.GATE),
    "pp-stagger1-queue3-spec": (lambda: _pp_stagger(3, 1, spec=3),
                                inflight.GATE),
    "pp-stagger2-queue5": (lambda: _pp_stagger(5, 2), inflight.GATE),
    "sync-batch-queue-drafts": (_sync_batch_queue, inflight.DRAFTS_SYNC),
}


def _run(h, rids, steps) -> list[str]:
    for _ in range(steps):
        h.engine_step()
    h.engine_drain()
    return g1.check(h, rids)


def _assert_grammar_valid(h, rids) -> None:
    """Each request finished by length with output the grammar accepts."""
    ref = g1.Reference(h)  # fresh grammars
    for rid in rids:
        ref.add(rid)
        em = h.emitted(rid)
        text = h.tokenizer.decode(em.token_ids)
        assert len(em.token_ids) == MAX_TOKENS, (rid, text)
        assert re.fullmatch(g1.REGEX, text), (rid, text)
        assert ref.grammar(rid).accept_tokens(rid, list(em.token_ids)), (
            rid, text)
        assert em.finish_reason == "length", (rid, em.finish_reason)
        assert h.request(rid).is_finished()


def _no_safety_net(stats: dict[str, int]) -> None:
    assert {k: stats[k] for k in inflight.SAFETY_NET} == dict.fromkeys(
        inflight.SAFETY_NET, 0), stats


@pytest.fixture
def strict_runtime(monkeypatch):
    monkeypatch.setenv("VLLM_PATCH_STRICT_RUNTIME", "1")


@pytest.fixture
def lenient_runtime(monkeypatch):
    """The default: the safety net corrects (whatever the caller's env)."""
    monkeypatch.delenv("VLLM_PATCH_STRICT_RUNTIME", raising=False)


@pytest.fixture
def bypass(patched):
    """Revert one G1 patch for the test (what a custom scheduler that
    overrides the method without calling the patched one amounts to); every
    patch is back afterwards. Stock: nothing to bypass."""
    import vllm_patch
    from vllm_patch import patching

    reverted = []

    def revert(name: str) -> None:
        if patched:
            patching.revert_patch(name)
            reverted.append(name)

    yield revert
    if reverted:
        vllm_patch.register()


# -------------------------------------------- vLLM's flows: no exception
@pytest.mark.parametrize("flow", list(FLOWS))
def test_engine_flow_runs_clean_under_strict_runtime(
        flow, patched, strict_runtime, monkeypatch):
    """vLLM's PP-stagger and sync-batch-queue flows run under
    VLLM_PATCH_STRICT_RUNTIME=1 (and the start-up VLLM_PATCH_STRICT=1, which
    has no runtime effect) without an exception: the mechanism holds
    requests back / keeps drafts aside, counted per scheduler, and every
    bitmask row and validated draft list is current."""
    monkeypatch.setenv("VLLM_PATCH_STRICT", "1")
    build, work = FLOWS[flow]
    before = dict(inflight.COUNTS)
    h, rids, steps = build()
    violations = _run(h, rids, steps)
    stats = inflight.stats(h.scheduler)
    if not patched:
        # Stock builds bitmask rows / validates drafts from a grammar that
        # lacks a launched step of the request.
        assert violations != [], f"stock unexpectedly holds G1 in {flow}"
        assert inflight.COUNTS == before
        return
    assert violations == []
    _assert_grammar_valid(h, rids)
    assert stats[work] > 0, stats
    _no_safety_net(stats)
    # The process totals moved by this scheduler's counts.
    assert {k: inflight.COUNTS[k] - before[k] for k in inflight.KINDS} == stats


# ------------------------------------------- a bypass of the mechanism raises
def _bitmask_before_previous_step():
    """A custom engine loop that ignores `pending_structured_output_tokens`:
    async, the request's decode step launched while its prefill step is in
    flight, then the decode step's bitmask built before the prefill's output
    is applied."""
    h = g1.harness(async_scheduling=True)
    (rid,) = g1.add_requests(h, 1)
    so1 = h.launch()
    so2 = h.launch()
    assert rid in so1.num_scheduled_tokens and rid in so2.num_scheduled_tokens
    assert so2.pending_structured_output_tokens
    assert h.request(rid).num_output_placeholders > 0  # so1 not applied
    return h, rid, so2


def test_bitmask_before_previous_step_raises(patched, strict_runtime):
    h, rid, so2 = _bitmask_before_previous_step()
    if not patched:
        # Stock builds the row from the grammar that lacks so1's token.
        out = h.scheduler.get_grammar_bitmask(so2)
        assert out is not None and rid in out.structured_output_request_ids
        return
    with pytest.raises(inflight.StaleGrammarError) as err:
        h.scheduler.get_grammar_bitmask(so2)
    msg = str(err.value)
    assert "VLLM_PATCH_STRICT_RUNTIME=1" in msg and rid in msg
    # Product words: no internal issue / gap numbers, no other setting.
    assert not re.search(r"#\d|\bgap\b|issue \d|VLLM_PATCH_STRICT=1", msg), msg
    assert inflight.stats(h.scheduler)[inflight.BITMASK] == 1


def test_bitmask_before_previous_step_corrected(patched, lenient_runtime,
                                                monkeypatch):
    """Without runtime strictness (the start-up VLLM_PATCH_STRICT=1 does not
    make it raise) the safety net corrects it: no row from the stale grammar,
    the request recomputes."""
    from vllm.v1.request import RequestStatus

    monkeypatch.setenv("VLLM_PATCH_STRICT", "1")
    h, rid, so2 = _bitmask_before_previous_step()
    out = h.scheduler.get_grammar_bitmask(so2)
    if not patched:
        assert out is not None and rid in out.structured_output_request_ids
        return
    assert out is None or rid not in out.structured_output_request_ids
    assert h.request(rid).status == RequestStatus.PREEMPTED
    assert inflight.unapplied_steps(h.scheduler, rid) == 0
    stats = inflight.stats(h.scheduler)
    assert stats[inflight.BITMASK] == 1
    assert sum(stats.values()) == 1, stats


def test_gate_bypass_raises(patched, strict_runtime, bypass):
    """The PP-stagger flow with the schedule gate bypassed (a custom
    scheduler): the bitmask safety net raises. Stock: the same flow shows
    the stale bitmask rows, nothing raises."""
    bypass("g1-gate-schedule")
    h, rids, steps = _pp_stagger(3, 1, spec=3)
    if not patched:
        assert _run(h, rids, steps) != []
        return
    with pytest.raises(inflight.StaleGrammarError,
                       match=r"bitmask.*VLLM_PATCH_STRICT_RUNTIME=1"):
        _run(h, rids, steps)
    assert inflight.stats(h.scheduler)[inflight.BITMASK] > 0


def test_draft_stash_bypass_raises(patched, strict_runtime, bypass):
    """The sync-batch-queue flow with the draft stash bypassed (a custom
    scheduler validating drafts itself): drafts validated while the
    request's step is in flight are found before they are scheduled and
    raise. Stock: the same flow shows the stale draft validation."""
    bypass("g1-drafts-sync")
    h, rids, steps = _sync_batch_queue()
    if not patched:
        assert _run(h, rids, steps) != []
        return
    with pytest.raises(inflight.StaleGrammarError,
                       match=r"draft tokens.*VLLM_PATCH_STRICT_RUNTIME=1"):
        _run(h, rids, steps)
    stats = inflight.stats(h.scheduler)
    assert stats[inflight.DRAFTS_STALE] > 0
    assert stats[inflight.DRAFTS_SYNC] == 0  # the stash really was bypassed


def test_draft_stash_bypass_corrected(patched, lenient_runtime, bypass):
    """Without runtime strictness the stale-validated drafts are dropped
    before they are scheduled: every scheduled draft list is current."""
    bypass("g1-drafts-sync")
    h, rids, steps = _sync_batch_queue()
    violations = _run(h, rids, steps)
    if not patched:
        assert violations != []
        return
    assert violations == []
    _assert_grammar_valid(h, rids)
    stats = inflight.stats(h.scheduler)
    assert stats[inflight.DRAFTS_STALE] > 0
    assert stats[inflight.BITMASK] == 0


# ------------------------------------------------------------------ logging
def test_one_log_line_per_kind(patched, lenient_runtime, caplog, bypass):
    """Each kind is logged once per process however often it happens (vLLM's
    *_once helpers): the mechanism's work at INFO, the safety net as a
    WARNING; the counts stay in stats()."""
    if not patched:
        pytest.skip("nothing is logged stock")
    import vllm.logger as vllm_logger

    for once in (vllm_logger._print_info_once,  # noqa: SLF001
                 vllm_logger._print_warning_once):  # noqa: SLF001
        once.cache_clear()
    caplog.set_level(logging.INFO, logger="vllm_patch")
    totals: dict[str, int] = dict.fromkeys(inflight.KINDS, 0)
    for _ in range(2):
        for build, _work in FLOWS.values():
            h, rids, steps = build()
            assert _run(h, rids, steps) == []
            for k, n in inflight.stats(h.scheduler).items():
                totals[k] += n
    bypass("g1-gate-schedule")
    for _ in range(2):
        h, rids, steps = _pp_stagger(3, 1, spec=3)
        _run(h, rids, steps)
        for k, n in inflight.stats(h.scheduler).items():
            totals[k] += n
    lines = [r for r in caplog.records if r.name == inflight.__name__
             and r.getMessage().startswith("vllm_patch G1:")]
    for kind in (inflight.GATE, inflight.DRAFTS_SYNC, inflight.BITMASK):
        assert totals[kind] > 1, totals
    for kind in inflight.KINDS:
        mine = [r for r in lines if f"(kind {kind!r})" in r.getMessage()]
        assert len(mine) == (1 if totals[kind] else 0), (
            kind, [r.getMessage() for r in mine])
        if mine:
            want = (logging.WARNING if kind in inflight.SAFETY_NET
                    else logging.INFO)
            assert mine[0].levelno == want
    assert len(lines) == sum(1 for n in totals.values() if n)
