"""G2: nothing past the grammar's end is committed (scheduler tier).

Every scenario of vllm_patch.conformance.g2 runs against the real scheduler:
patched, it must hold; stock (VLLM_PATCH_DISABLE=1), each `stock_fails`
scenario must show the failure the patch removes, and the controls must hold.
"""

from __future__ import annotations

import pytest

from vllm_patch.conformance import g2
from vllm_patch.patching import version_series, vllm_version

pytestmark = pytest.mark.scheduler

SERIES = version_series(vllm_version())


@pytest.mark.parametrize("scenario", g2.SCENARIOS, ids=lambda s: s.name)
def test_g2_scenario(scenario, check_scenario):
    check_scenario(scenario)


def _unstructured_run():
    """A scripted mixed batch; returns what the unstructured requests emitted
    and their end state."""
    from vllm_patch.testing.harness import EOS, Harness

    out = []
    for async_ in (False, True):
        h = Harness("xgrammar", num_spec_tokens=3, async_scheduling=async_)
        x, y = h.tok("x"), h.tok("y")
        p = [x, y, x, y]
        u = [h.add_request(p, ignore_eos=True, logprobs=1, max_tokens=7),
             h.add_request(p, logprobs=1, max_tokens=20),
             h.add_request(p, stop_token_ids=[y], max_tokens=20)]
        if async_:
            h.launch()
            h.launch(drafts={r: [x, EOS, x] for r in u})
            h.finish_oldest({r: [x] for r in u})
            h.launch(drafts={r: [y, y, y] for r in u})
            h.finish_oldest({r: [x, EOS, x, y] for r in u})
            h.finish_oldest({r: [y, y] for r in u})
        else:
            h.step({r: [x] for r in u}, drafts={r: [x, EOS, x] for r in u})
            h.step({r: [x, EOS, x, y] for r in u}, drafts={r: [y, y] for r in u})
            live = [r for r in u if not h.request(r).is_finished()]
            h.step({r: [y, y, x] for r in live})
        for r in u:
            req = h.request(r)
            e = h.emitted(r)
            out.append((async_, e.token_ids, e.logprob_rows, e.finish_reason,
                        e.stop_reason, req.status.name, req.num_tokens,
                        len(req.block_hashes), h.spec_totals()))
        h.drain()
        out.append(h.held_blocks())
    return out


def test_unstructured_identical_to_stock(patched):
    """Requests without structured output behave exactly as stock (emitted
    tokens, logprobs, finish/stop reasons, status, hashes, spec stats)."""
    import vllm_patch
    from vllm_patch import patching

    with_patches = _unstructured_run()
    if not patched:
        return  # stock run: nothing to compare against
    patching.revert_all()
    try:
        stock = _unstructured_run()
    finally:
        vllm_patch.register()
    assert with_patches == stock


def test_stop_on_grammar_termination_off(patched, native, monkeypatch):
    """VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION=0 restores stock termination
    (post-terminal tokens emitted, request keeps running) and keeps the
    rejection trim."""
    if "G2" in native:
        pytest.skip("a vLLM build carrying G2 always stops at the grammar's "
                    "end: the switch has no effect there (series tier)")
    monkeypatch.setenv("VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION", "0")
    by_name = {s.name: s for s in g2.SCENARIOS}
    p1 = by_name["g2-xgrammar-eos-mid-step"]
    # Both modes: stock's P1 failure exactly (tokens after the end emitted,
    # the request keeps running).
    assert p1.run() == p1.expected_stock(SERIES)
    if patched:
        # Every backend: exactly what stock does after the grammar's end
        # (guidance: stock's own accept then rejects the token after EOS).
        import vllm_patch
        from vllm_patch import patching

        names = ("g2-xgrammar-eos-mid-step", "g2-guidance",
                 "g2-outlines", "g2-outlines-bonus", "g2-multi-step-outlines")
        off = {n: by_name[n].run() for n in names}
        patching.revert_all()
        try:
            stock = {n: by_name[n].run() for n in names}
        finally:
            vllm_patch.register()
        assert off == stock == {n: by_name[n].expected_stock(SERIES)
                                for n in names}
    p6 = by_name["g2-rejection-xgrammar"]
    assert p6.run() == ([] if patched else p6.expected_stock(SERIES))


def test_rejection_logs_once(patched, plugin_g2, caplog):
    """One log line naming the request and the rejected token."""
    import logging

    caplog.set_level(logging.ERROR, logger="vllm_patch")
    by_name = {s.name: s for s in g2.SCENARIOS}
    by_name["g2-rejection-xgrammar"].run()
    lines = [r.getMessage() for r in caplog.records
             if r.name.startswith("vllm_patch") and "G2" in r.getMessage()]
    if patched:
        assert len(lines) == 1 and "rejected token" in lines[0], lines
    else:
        assert lines == []


def test_bitmask_and_acceptable_drafts_recorded():
    """Harness self-check: per-step bitmask rows and num_acceptable_drafts
    are captured. The row after the terminal draft allows everything on
    stock (audit 2.2); G3's worker-side hardening may narrow it to the stop
    tokens, so either is accepted here."""
    from vllm_patch.testing.harness import EOS, IM_END, Harness

    h = Harness("xgrammar", num_spec_tokens=3)
    a, b, c = h.tok("a"), h.tok("b"), h.tok("c")
    rid = h.add_request([h.tok("x")] * 4, regex="ab", ignore_eos=True)
    h.step({rid: [a]}, drafts={rid: [b, EOS, c]})
    rec = h.step({rid: [b, EOS, c]})
    rows = rec.bitmask_rows[rid]
    assert rec.spec_tokens[rid] == [b, EOS]
    assert h.allowed(rows[0]) == [b]
    assert set(h.allowed(rows[1])) == {EOS, IM_END}
    assert len(h.allowed(rows[2])) == len(h.tokenizer) or \
        set(h.allowed(rows[2])) <= {EOS, IM_END}
    if rec.num_acceptable_drafts is not None:
        assert rec.num_acceptable_drafts[rid] == 2
    h.drain()


def test_fallback_without_accept_once(patched, plugin_g2):
    """Without g2-accept-once (skipped / signature mismatch) the scheduler
    wrapper must not advance the grammar (stock would accept the same tokens
    again): it falls back to validate-only and every scenario still holds."""
    if not patched:
        pytest.skip("patched run only")
    import vllm_patch
    from vllm_patch import patching
    from vllm_patch.v1.core.sched.scheduler.g2_commit_cut import ACCEPT_PATCH

    assert patching.REGISTRY.outcomes[ACCEPT_PATCH].state is \
        patching.State.APPLIED
    patching.revert_patch(ACCEPT_PATCH)
    try:
        failed = {s.name: v for s in g2.SCENARIOS if SERIES in s.series
                  for v in [s.run()] if v}
    finally:
        vllm_patch.register()
    assert failed == {}


@pytest.mark.parametrize("backend", ["xgrammar", "guidance", "outlines"])
def test_one_grammar_walk_per_step(patched, plugin_g2, backend):
    """Patched: stock's post-append accept_tokens never reaches the grammar
    for tokens the wrapper already accepted; xgrammar does no separate
    validation either (one walk per step, as stock)."""
    if not patched:
        pytest.skip("patched run only")
    from vllm_patch.testing.harness import Harness

    h = Harness(backend, num_spec_tokens=3)
    a, b, c = h.tok("a"), h.tok("b"), h.tok("c")
    rid = h.add_request([h.tok("x")] * 4, regex="[abc]+", ignore_eos=True,
                        max_tokens=100)
    g = h.grammar(rid)
    calls = {"accept_tokens": 0, "validate_tokens": 0}

    def spy(name):
        real = getattr(g, name)

        def f(*args):
            calls[name] += 1
            return real(*args)
        return f

    stream = [a] + [b, c, a] * 6  # tokens the "model" samples, in order
    h.step({rid: stream[:1]}, drafts={rid: stream[1:4]})
    for i in range(3):
        so = h.schedule()
        h.grammar_bitmask(so)  # the schedule-time walk is not counted
        for name in calls:
            g.__dict__[name] = spy(name)
        h.run_model(so, {rid: stream[1 + 4 * i:5 + 4 * i]})
        for name in calls:
            del g.__dict__[name]
        h.set_drafts({rid: stream[5 + 4 * i:8 + 4 * i]})
    want = {"accept_tokens": 0, "validate_tokens": 0} \
        if backend == "xgrammar" else {"accept_tokens": 3,
                                       "validate_tokens": 3}
    assert calls == want
    assert h.emitted(rid).token_ids == stream[:13]
    assert not h.request(rid).is_finished()
    if backend == "xgrammar":  # the fields stock's accept loop maintains
        assert g.num_processed_tokens == 13 and not g.is_terminated()
    h.drain()
