"""Speculative verification rows on several threads (scheduler tier).

The real Scheduler and real xgrammar and llguidance grammars, a batch large
enough for vLLM to create its fill pool (`max_num_seqs` > 128) and for the
walk to be threaded (MIN_ROWS rows): requests whose drafts end the grammar,
hit an invalid token, or are all valid, sync and async (-1 padding), and
the same walk over drafts the scheduler did not trim (invalid tokens inside
the walk). Patched: the step's bitmask is built on several threads (xgrammar:
vLLM's fill pool; llguidance: the library's batch walk on its own threads)
and equals, row for row, the serial walk of the same step, and G3's rows
(stop tokens only after a terminal draft) are in it. Stock
(VLLM_PATCH_DISABLE=1): vLLM never fills rows in parallel when there are
drafts: every row is filled on the engine thread.

The threaded walk is its own patch (`parallel-verify-rows`), so it applies
whether G3's rows come from the plugin (`g3-bitmask-rows`, on a released
vLLM) or from a vLLM build that fills them itself (the patch series, which
names `g3-bitmask-rows`): the series tier runs this file on that build
with the plugin installed.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytestmark = pytest.mark.scheduler

REGEXES = ("ab", "abc", "abcab", "(ab)+c", "a(b|c)+", "[abc]{2,6}")


def _spy_pool(manager):
    """Count the tasks submitted to vLLM's fill pool."""
    pool = manager.executor_for_fillmask
    calls = []
    submit = pool.submit

    def counted(*a, **kw):
        calls.append(a)
        return submit(*a, **kw)

    pool.submit = counted
    return calls


def _spy_library_walk(monkeypatch):
    """Count llguidance's batch walks (the threaded walk with guidance)."""
    import llguidance.torch as llt

    calls = []
    walk = llt.fill_next_token_bitmask_par_with_draft_tokens

    def counted(*a, **kw):
        calls.append(a)
        return walk(*a, **kw)

    monkeypatch.setattr(llt, "fill_next_token_bitmask_par_with_draft_tokens",
                        counted)
    return calls


def _saved_grammars(h, ids):
    """A function that puts the requests' grammars back as they are now
    (an llguidance grammar's matcher is copied; others keep no state a
    walk leaves behind: xgrammar refuses a token without moving)."""
    saved = []
    for rid in ids:
        g = h.requests[rid].structured_output_request.grammar
        matcher = getattr(g, "ll_matcher", None)
        saved.append((g, dict(vars(g)),
                      matcher.deep_copy() if matcher is not None else None))

    def restore():
        for g, fields, matcher in saved:
            vars(g).update(fields)
            if matcher is not None:
                g.ll_matcher = matcher.deep_copy()

    return restore


def _batch(h, n):
    a, b, c, x = (h.tok(t) for t in "abcx")
    rids = [h.add_request(regex=REGEXES[i % len(REGEXES)], ignore_eos=i % 2 == 0)
            for i in range(n)]
    for rid in rids:
        h.wait_for_grammar(rid)
    # Drafts: all valid, one invalid token, and a grammar end (EOS) inside.
    from vllm_patch.testing.harness import EOS
    shapes = ([b, c, a], [b, x, c], [b, EOS, c], [c, b, b], [b, c, c])
    drafts = {rid: list(shapes[i % len(shapes)]) for i, rid in enumerate(rids)}
    return rids, drafts, a


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_threaded_rows_equal_serial_rows(patched, native, async_, backend,
                                         monkeypatch):
    from vllm_patch.testing.harness import EOS, Harness
    from vllm_patch.v1.structured_output import parallel_rows

    h = Harness(backend, num_spec_tokens=3, async_scheduling=async_,
                max_num_seqs=192, num_blocks=512, max_num_batched_tokens=4096)
    manager = h.scheduler.structured_output_manager
    assert manager.executor_for_fillmask is not None  # vLLM made its pool

    class Always(parallel_rows.Choice):
        def threaded(self) -> bool:
            return True

    setattr(manager, parallel_rows._CHOICE_ATTR, Always())
    # The tiny model's vocabulary is under the threads' vocabulary gate
    # (test_plan_and_gates); opened here, the walk under test is the same.
    monkeypatch.setattr(parallel_rows, "MIN_VOCAB", 0)
    rids, drafts, a = _batch(h, 64)
    if async_:
        h.launch()
        h.launch(drafts=drafts)
        h.finish_oldest({r: [a] for r in rids})
    else:
        h.step({r: [a] for r in rids}, drafts=drafts)
    so = h.schedule()
    spec = so.scheduled_spec_decode_tokens
    assert sum(1 + len(spec.get(r, ())) for r in rids) >= parallel_rows.MIN_ROWS
    if async_:
        assert any(-1 in t for t in spec.values())  # padding after invalid drafts
    ids = [r for r in rids if r in so.num_scheduled_tokens]

    calls = (_spy_pool(manager) if backend == "xgrammar"
             else _spy_library_walk(monkeypatch))

    threaded = np.array(manager.grammar_bitmask(h.requests, ids, spec))
    used = len(calls)
    monkeypatch.setenv("VLLM_PATCH_PARALLEL_VERIFY", "0")
    serial = np.array(manager.grammar_bitmask(h.requests, ids, spec))
    assert len(calls) == used  # the serial walk uses no threads
    monkeypatch.delenv("VLLM_PATCH_PARALLEL_VERIFY")
    assert threaded.shape == serial.shape
    assert (threaded == serial).all()  # same rows, row for row
    # G3's rows in the threaded walk: after a terminal draft (the shape
    # [b, EOS, c], sync) only stop tokens, and after a request's first -1
    # draft (async) the row at it; stock allows every token there.
    k1 = h.num_spec_tokens + 1
    packed = threaded.shape[0] != len(ids) * k1  # 0.32 (else 0.33: k + 1 each)
    start, checked = 0, []
    for i, rid in enumerate(ids):
        toks = spec.get(rid, [])
        first = start if packed else i * k1
        rows = threaded[first:first + 1 + len(toks)]
        start += 1 + len(toks)
        if -1 in toks:
            p = toks.index(-1)
            checked += [(r, rows[p]) for r in rows[p + 1:]]
        elif len(toks) >= 2 and toks[1] == EOS:
            checked += [(r, None) for r in rows[2:]]
    assert checked, spec
    full = [len(h.allowed(r)) == len(h.tokenizer) for r, _ in checked]
    if patched or "g3-bitmask-rows" in native:  # a build's own rows too
        assert not any(full)
        for r, at_padding in checked:
            if at_padding is None:  # stop tokens (xgrammar: EOS, im_end)
                assert h.allowed(r) == ([EOS, 3] if backend == "xgrammar"
                                        else [EOS])
            else:
                assert (r == at_padding).all()
    else:
        assert all(full)
    # Every grammar is back where it was: the same walk once more is equal.
    again = np.array(manager.grammar_bitmask(h.requests, ids, spec))
    assert (again == serial).all()
    # Drafts the scheduler did not trim: invalid tokens in the walk (stock
    # repeats the row of the refused draft); async, as the engine hands the
    # worker's drafts over (the valid prefix, then -1). Stock's serial walk
    # leaves an llguidance matcher in its error state after a refused draft
    # (its rollback does not undo that; a real step never has such a draft,
    # the scheduler trims them first), so each walk starts from the same
    # saved grammars, and the step's own walk after them.
    raw = {r: list(drafts[r]) for r in ids}
    if async_:
        for r, toks in raw.items():
            valid = manager.validate_tokens(h.requests[r], toks)
            raw[r] = valid + [-1] * (len(toks) - len(valid))
    assert any(raw[r] != spec.get(r, []) for r in ids)
    restore = _saved_grammars(h, ids)
    monkeypatch.setenv("VLLM_PATCH_PARALLEL_VERIFY", "0")
    serial_raw = np.array(manager.grammar_bitmask(h.requests, ids, raw))
    monkeypatch.delenv("VLLM_PATCH_PARALLEL_VERIFY")
    restore()
    threaded_raw = np.array(manager.grammar_bitmask(h.requests, ids, raw))
    restore()
    assert (threaded_raw == serial_raw).all()
    # 0.33 leaves a request's rows past its drafts as they were (k + 1 rows
    # each): the step's walk starts from the rows it left.
    import torch
    manager._grammar_bitmask[:len(serial)].copy_(torch.from_numpy(serial))
    assert (np.array(manager.grammar_bitmask(h.requests, ids, spec))
            == serial).all()
    if patched:
        # xgrammar: the pool walked chunks beside the engine thread, also
        # for the step's own drafts (-1 placeholders, async); llguidance:
        # the library walked the requests whose drafts are real tokens.
        assert used >= 1 or (backend == "guidance" and async_)
        assert len(calls) >= 1
    else:
        assert len(calls) == 0  # stock: with drafts, never on threads


def test_drafting_prices_rows_at_the_threaded_walk(patched, monkeypatch, caplog):
    """The price grammar-aware drafting puts on a verification row its
    drafts add: the scheduler's own measured ratio of the wall time per row
    threaded to serial, read from the scheduler's manager (in-process
    executor), where its walk would be threaded; 1.0 (a serial fill)
    where it would not (too few rows, switched off) or where the drafter
    cannot know (a multiprocess worker's own manager). Stock: vLLM's walk
    measures nothing and never uses the pool with drafts: the price stays
    a serial fill's."""
    import statistics

    from vllm_patch.testing.harness import Harness
    from vllm_patch.v1.spec_decode import grammar_drafts as gd
    from vllm_patch.v1.structured_output import parallel_rows as pr

    h = Harness("xgrammar", num_spec_tokens=3, max_num_seqs=192,
                num_blocks=512, max_num_batched_tokens=4096)
    manager = h.scheduler.structured_output_manager
    assert manager.executor_for_fillmask is not None  # vLLM made its pool
    rids, drafts, a = _batch(h, 64)
    h.step({r: [a] for r in rids}, drafts=drafts)
    so = h.schedule()
    spec = so.scheduled_spec_decode_tokens
    ids = [r for r in rids if r in so.num_scheduled_tokens]
    rows = sum(1 + len(spec.get(r, ())) for r in ids)
    assert rows >= pr.MIN_ROWS
    calls = _spy_pool(manager)
    # The tiny vocabulary is under the vocabulary gate: serial walks, no
    # threaded walk measured against them, a serial fill's price.
    for _ in range(4):
        manager.grammar_bitmask(h.requests, ids, spec)
    choice = getattr(manager, pr._CHOICE_ATTR, None)
    assert not calls
    if patched:
        assert not choice.per_row[False] and not choice.per_row[True]
    assert pr.row_factor(manager, rows) == 1.0
    monkeypatch.setattr(pr, "MIN_VOCAB", 0)  # opened: the pricing
    for _ in range(8):  # the scheduler's walks of one step, measured
        manager.grammar_bitmask(h.requests, ids, spec)
    bound = gd.Tracker(masked=True, forced=True)
    bound.manager_ref = __import__("weakref").ref(manager)
    local = gd.Tracker(masked=True, forced=True)
    local.local_manager = manager  # a worker's own: not the scheduler's
    local.manager_ref = bound.manager_ref
    choice = getattr(manager, pr._CHOICE_ATTR, None)
    if not patched:
        assert choice is None and not calls  # nothing measured, no pool
        assert pr.row_ns(manager) is None and gd._verify_row_ns(bound) is None
        assert pr.row_factor(manager, rows) == 1.0
        assert gd._verify_row_factor(bound, rows) == 1.0
        return
    serial, threaded = choice.per_row[False], choice.per_row[True]
    assert len(serial) >= 2 and len(threaded) >= 2 and calls
    want = min(1.0, statistics.median(threaded) / statistics.median(serial))
    assert pr.row_factor(manager, rows) == pytest.approx(want)
    assert gd._verify_row_factor(bound, rows) == pytest.approx(want)
    # Where the scheduler's walk is serial, or the drafter cannot know it.
    assert gd._verify_row_factor(local, rows) == 1.0
    assert pr.row_factor(manager, pr.MIN_ROWS - 1) == 1.0
    monkeypatch.setenv("VLLM_PATCH_PARALLEL_VERIFY", "0")
    assert pr.row_factor(manager, rows) == 1.0
    monkeypatch.delenv("VLLM_PATCH_PARALLEL_VERIFY")
    # Threads measured 2.5x cheaper per row: a row costs 0.4 of a serial
    # fill; measured dearer: the walk stays serial, a serial fill's price.
    choice.per_row[False].extend([100.0] * 5)
    choice.per_row[True].extend([40.0] * 5)
    assert gd._verify_row_factor(bound, rows) == pytest.approx(0.4)
    choice.per_row[True].extend([130.0] * 5)
    assert gd._verify_row_factor(bound, rows) == 1.0
    # A price that cannot be read: a serial fill's, and a warning says so.
    def broken(manager, rows):
        raise RuntimeError("no price")

    monkeypatch.setattr(pr, "row_factor", broken)
    with caplog.at_level(logging.WARNING):
        assert gd._verify_row_factor(bound, rows) == 1.0
    assert "could not read the scheduler's threaded verification price" \
        in caplog.text


def test_drafting_prices_rows_at_the_schedulers_own_walk(patched):
    """The scheduler's manager times each of its verification walks (wall
    time per row, the first walk left out); grammar-aware drafting reads
    the median as the price of a row its drafts add, where this process
    holds the scheduler's manager (not a worker's own). Stock: nothing is
    timed."""
    import statistics
    import weakref

    from vllm_patch.testing.harness import Harness
    from vllm_patch.v1.spec_decode import grammar_drafts as gd
    from vllm_patch.v1.structured_output import parallel_rows as pr

    h = Harness("xgrammar", num_spec_tokens=3)
    manager = h.scheduler.structured_output_manager
    rids, drafts, a = _batch(h, 8)
    h.step({r: [a] for r in rids}, drafts=drafts)
    so = h.schedule()
    spec = so.scheduled_spec_decode_tokens
    ids = [r for r in rids if r in so.num_scheduled_tokens]
    bound = gd.Tracker(masked=True, forced=True)
    bound.manager_ref = weakref.ref(manager)
    local = gd.Tracker(masked=True, forced=True)
    local.local_manager = manager
    local.manager_ref = bound.manager_ref
    for _ in range(pr.WINDOW):
        manager.grammar_bitmask(h.requests, ids, spec)
    if not patched:
        assert pr.row_ns(manager) is None and gd._verify_row_ns(bound) is None
        return
    walks = getattr(manager, pr._CHOICE_ATTR).walks
    assert len(walks) == pr.WINDOW and all(ns > 0 for ns in walks)
    assert pr.row_ns(manager) == statistics.median(walks)
    assert gd._verify_row_ns(bound) == pr.row_ns(manager)
    assert gd._verify_row_ns(local) is None  # a worker's own manager


@pytest.mark.patched_only
def test_walk_price_leaves_out_the_first_walk():
    from vllm_patch.v1.structured_output.parallel_rows import Choice

    c = Choice()
    c.record_walk(900_000, 10)  # cold: new grammar states
    assert not c.walks
    c.record_walk(200_000, 10)
    c.record_walk(0, 0)  # no rows: nothing to price
    assert list(c.walks) == [20_000.0]


@pytest.mark.patched_only
def test_choice_ratio():
    from vllm_patch.v1.structured_output.parallel_rows import Choice

    c = Choice()
    assert c.ratio() == 1.0  # nothing measured
    for t, ns in [(False, 0), (False, 3000), (False, 3000), (True, 0),
                  (True, 1000)]:
        c.record(t, ns, 10)
    assert c.ratio() == 1.0  # one threaded walk kept: not measured twice
    c.record(True, 1000, 10)
    assert c.ratio() == pytest.approx(1 / 3)
    assert c.threaded() is True and c.ratio() == pytest.approx(1 / 3)


@pytest.mark.patched_only
def test_choice_measures_serial_first_then_keeps_the_cheaper():
    from vllm_patch.v1.structured_output.parallel_rows import PROBE_EVERY, Choice

    c = Choice()
    modes = []
    for _ in range(6):
        t = c.threaded()
        modes.append(t)
        c.record(t, 1000 if t else 3000, 10)  # threads 3x cheaper per row
    # Serial three times (the first not kept), then threaded three times.
    assert modes == [False, False, False, True, True, True]
    assert all(c.threaded() for _ in range(PROBE_EVERY - 8))
    # A probe of the other mode every PROBE_EVERY steps.
    seen = [c.threaded() for _ in range(PROBE_EVERY)]
    assert seen.count(False) == 1


@pytest.mark.patched_only
def test_choice_stays_serial_where_threads_lose():
    from vllm_patch.v1.structured_output.parallel_rows import Choice

    c = Choice()
    for _ in range(8):
        t = c.threaded()
        c.record(t, 1300 if t else 1000, 10)  # threads dearer (GIL-bound)
    assert [c.threaded() for _ in range(20)] == [False] * 20


@pytest.mark.patched_only
def test_plan_and_gates():
    from types import SimpleNamespace

    from vllm_patch.v1.structured_output import parallel_rows as pr

    assert pr.plan([4] * 10) == [(0, 10)]  # under MIN_ROWS: serial
    ranges = pr.plan([5] * 64)
    assert ranges[0][0] == 0 and ranges[-1][1] == 64
    assert all(lo < hi for lo, hi in ranges)
    assert all(r[1] == n[0] for r, n in zip(ranges, ranges[1:]))  # contiguous
    assert len(ranges) > 2
    pool = SimpleNamespace(_max_workers=4)

    def manager(kind, vocab, executor=pool):
        return SimpleNamespace(backend=type(kind, (), {"vocab_size": vocab})(),
                               executor_for_fillmask=executor)

    ids = ["a", "b"]
    assert pr.wanted(manager("XgrammarBackend", 131072), ids)
    assert pr.wanted(manager("XgrammarBackend", pr.MIN_VOCAB), ids)
    # llguidance walks the batch on its own threads.
    assert pr.wanted(manager("GuidanceBackend", 131072), ids)
    # Outlines' fill holds the GIL and has no batch walk.
    assert not pr.wanted(manager("OutlinesBackend", 131072), ids)
    # A 32k vocabulary's fills are too short for threads to pay.
    assert not pr.wanted(manager("XgrammarBackend", 32768), ids)
    assert pr.row_factor(manager("XgrammarBackend", 32768), 1024) == 1.0
    no_pool = manager("XgrammarBackend", 131072, None)
    assert pr.lanes(no_pool) == 1 and not pr.wanted(no_pool, ids)


@pytest.mark.patched_only
def test_an_error_in_a_chunk_is_raised_after_every_chunk_ended():
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    import torch

    from vllm_patch.v1.structured_output import parallel_rows as pr

    class Always(pr.Choice):
        def threaded(self) -> bool:
            return True

    ended, lock = [], threading.Lock()

    def walk_serial(view, requests, ids, spec):
        if "r0" in ids:
            raise RuntimeError("grammar failed")
        with lock:
            ended.extend(ids)

    pool = ThreadPoolExecutor(max_workers=2)
    m = SimpleNamespace(backend=type("XgrammarBackend", (),
                                     {"vocab_size": 131072})(),
                        executor_for_fillmask=pool,
                        _grammar_bitmask=torch.zeros(1024, 4, dtype=torch.int32),
                        vllm_config=SimpleNamespace(num_speculative_tokens=4))
    setattr(m, pr._CHOICE_ATTR, Always())
    ids = [f"r{i}" for i in range(100)]
    spec = {r: [1, 2, 3, 4] for r in ids}
    with pytest.raises(RuntimeError, match="grammar failed"):
        pr.walk(m, walk_serial, {}, ids, spec, None)
    pool.shutdown(wait=True)
    assert not [r for r in ended if r == "r0"]


@pytest.mark.patched_only
def test_own_patch_applies_when_g3_rows_are_the_builds(monkeypatch):
    """On a vLLM build whose patch series names `g3-bitmask-rows` (it fills
    G3's rows itself) the plugin does not apply that patch, and the threaded
    walk, a patch of its own on another attribute, still applies; G3 reads
    patched, partly native."""
    from vllm_patch import envs, patching
    from vllm_patch.patching import REGISTRY, State

    # A build from this repository's series carries G3 whole (0005's rows
    # and 0006's V1 runner side): the plugin's other G3 patches are native
    # there too, so G3 cannot read partly native (the series tier runs
    # this test on such a build).
    carries_g3 = patching.guarantee_native("G3")
    rows = REGISTRY.patches["g3-bitmask-rows"]
    threaded = REGISTRY.patches["parallel-verify-rows"]
    assert rows.target != threaded.target
    assert threaded.guarantee == "package" and rows.guarantee == "G3"
    monkeypatch.setattr(patching, "_NATIVE", [{"g3-bitmask-rows": "g3_rows"}])
    monkeypatch.setattr(patching, "_NATIVE_GUARANTEES", [{}])
    settings = envs.settings()
    monkeypatch.delitem(REGISTRY.outcomes, rows.name, raising=False)
    native = patching._check(rows, settings)
    assert native.state is State.NATIVE and native.detail == "g3_rows"
    monkeypatch.setitem(REGISTRY.outcomes, rows.name, native)
    outcome = patching._check(threaded, settings)
    if isinstance(outcome, patching._Verified):  # not applied yet: it would be
        outcome = patching._install(threaded, outcome)
        monkeypatch.setitem(REGISTRY.outcomes, threaded.name, outcome)
    assert outcome.state is State.APPLIED
    g3 = {r["guarantee"]: r for r in patching.guarantee_table(settings)}["G3"]
    if carries_g3:
        assert g3["status"] == State.NATIVE.value
        return
    assert g3["status"] == "patched"
    assert g3["reason"].startswith(patching.PARTLY_NATIVE + ": g3-bitmask-rows")
    assert {r["status"] for r in g3["runners"].values()} == {"patched"}


@pytest.mark.patched_only
def test_build_digest_is_accepted_only_for_the_pinned_function():
    """The threaded walk's pins accept the release's grammar_bitmask and
    guidance accept_tokens and the patched build's (BUILD_DIGESTS: the
    series changes both), the release's source alone elsewhere."""
    from vllm_patch import audited
    from vllm_patch.patching import REGISTRY

    pins = {p.target: p for p in REGISTRY.patches["parallel-verify-rows"].pins}
    on_build = {
        "vllm.v1.structured_output:StructuredOutputManager.grammar_bitmask",
        "vllm.v1.structured_output.backend_guidance:GuidanceGrammar.accept_tokens",
    }
    assert on_build < set(pins)
    for target, p in pins.items():
        assert p.digests == audited.DIGESTS[target]
        if target in on_build:
            assert p.build_digests == audited.BUILD_DIGESTS[target]
            assert set(p.build_digests.values()).isdisjoint(p.digests.values())
        else:
            assert not p.build_digests and target not in audited.BUILD_DIGESTS
    # G3's row patch is not applied on such a build: it accepts no build digest.
    assert all(not q.build_digests
               for q in REGISTRY.patches["g3-bitmask-rows"].pins)
