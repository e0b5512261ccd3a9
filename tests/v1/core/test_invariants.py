"""Issue 8: the runtime invariant checker (vllm_patch.v1.core.sched.invariants)."""

from __future__ import annotations

import pytest

from vllm_patch.testing.harness import EOS, Harness
from vllm_patch.v1.core.sched import invariants as inv

pytestmark = pytest.mark.scheduler


def test_patches_opt_in(monkeypatch):
    """Not applied unless VLLM_PATCH_CHECK_INVARIANTS=1 (cheap when off)."""
    from vllm_patch import envs, patching

    monkeypatch.delenv("VLLM_PATCH_CHECK_INVARIANTS", raising=False)
    for p in inv.PATCHES:
        assert p.enabled(envs.settings()) is False
    monkeypatch.setenv("VLLM_PATCH_CHECK_INVARIANTS", "1")
    s = envs.settings()
    for p in inv.PATCHES:
        assert p.enabled(s) is (not s.disable)
    if s.disable:
        return
    applied = {p.name for p in inv.PATCHES
               if (o := patching.REGISTRY.outcomes.get(p.name)) is not None
               and o.state is patching.State.APPLIED}
    try:
        outcomes = [patching.apply_patch(p, s) for p in inv.PATCHES]
        assert all(o.state is patching.State.APPLIED for o in outcomes), outcomes
        from vllm.v1.core.sched.scheduler import Scheduler

        assert getattr(Scheduler.__init__, patching.NAME_ATTR) \
            == inv.CHECK_PATCH
        # Every scheduler built from now on is checked (instance wrappers;
        # the class methods stay G1's alone).
        h = Harness("xgrammar")
        assert inv._ATTR in h.scheduler.__dict__  # noqa: SLF001
        assert "update_from_output" in h.scheduler.__dict__
        assert "_update_after_schedule" in h.scheduler.__dict__
    finally:
        for p in inv.PATCHES:
            if p.name not in applied:  # leave the session's checker on
                patching.revert_patch(p.name)


def _post_terminal_run(h: Harness):
    """regex "ab", ignore_eos, drafts past the end: ['a'], then
    ['b', EOS, 'c'] accepted in one step."""
    rid = h.add_request([70, 71], regex="ab", ignore_eos=True, logprobs=1)
    h.step({rid: [h.tok("a")]}, drafts={rid: [h.tok("b"), EOS, h.tok("c")]})
    h.step({rid: [h.tok("b"), EOS, h.tok("c"), h.tok("c")]}, clip=True)
    return rid


def test_raises_with_request_and_state(patched):
    h = Harness("xgrammar", num_spec_tokens=3)
    inv.instrument(h.scheduler)
    inv.set_mode(h.scheduler, "raise")
    if patched:
        _post_terminal_run(h)  # holds
        h.drain()
        inv.checker(h.scheduler).check_idle()
        return
    with pytest.raises(inv.InvariantViolation) as ei:
        _post_terminal_run(h)
    e = ei.value
    assert e.invariant in ("post_terminal", "grammar_sync")
    assert e.request_id == "r0"
    assert "num_computed_tokens" in e.state


def test_detects_negative_placeholders_and_leak(patched):
    """Corrupt the state by hand: the checker names the invariant."""
    h = Harness("xgrammar")
    c = inv.instrument(h.scheduler)
    got = []
    inv.set_mode(h.scheduler, "record", got.append)
    rid = h.add_request([70, 71], max_tokens=3)
    h.step({rid: [h.tok("a")]})
    h.request(rid).num_output_placeholders = -1
    h.step({rid: [h.tok("a")]})
    assert [(v.invariant, v.request_id) for v in got] == [("placeholders", rid)]
    h.request(rid).num_output_placeholders = 0
    h.drain()
    # Leak one block: idle check fails.
    pool = h.scheduler.kv_cache_manager.block_pool
    pool.get_new_blocks(1)
    c.check_idle()
    assert got[-1].invariant == "idle_pool" and got[-1].request_id is None


def test_serving_counts_on_prometheus_and_logs_once(caplog):
    from prometheus_client import REGISTRY

    h = Harness("xgrammar")
    inv.instrument(h.scheduler)
    inv.set_mode(h.scheduler, "serve")
    name = "vllm_patch_invariant_violations_total"
    before = REGISTRY.get_sample_value(name, {"invariant": "placeholders"}) or 0
    rid = h.add_request([70, 71], max_tokens=4)
    h.step({rid: [h.tok("a")]})
    h.request(rid).num_output_placeholders = -2
    h.step({rid: [h.tok("a")]})
    h.step({rid: [h.tok("a")]})
    after = REGISTRY.get_sample_value(name, {"invariant": "placeholders"})
    assert after == before + 1  # once per request and invariant
    assert sum("invariant placeholders violated" in r.getMessage()
               for r in caplog.records) == 1


@pytest.mark.parametrize("backend", ["xgrammar", "guidance", "outlines"])
@pytest.mark.parametrize("async_", [False, True])
def test_clean_run_no_violation(backend, async_, patched):
    """A normal structured + unstructured run holds every invariant (also
    stock: no grammar end crossed), both schedulers, all backends."""
    h = Harness(backend, async_scheduling=async_)
    inv.instrument(h.scheduler)
    inv.set_mode(h.scheduler, "raise")
    a = h.add_request([70, 71], regex="(ab|cd)e", logprobs=1)
    b = h.add_request([70, 71, 72], max_tokens=3, logprobs=0)
    seq = {a: [h.tok("a"), h.tok("b"), h.tok("e"), EOS],
           b: [h.tok("x")] * 3}
    if async_:
        h.launch()
        for i in range(4):
            h.launch()
            h.finish_oldest({r: [s[i]] for r, s in seq.items()
                             if not h.request(r).is_finished()})
    else:
        for i in range(4):
            h.step({r: [s[i]] for r, s in seq.items()
                    if not h.request(r).is_finished()})
    h.drain()
    inv.checker(h.scheduler).check_idle()
    assert h.emitted(a).finish_reason == "stop"
