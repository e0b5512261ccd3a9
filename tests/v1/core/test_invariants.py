"""The runtime invariant checker (vllm_patch.v1.core.sched.scheduler.invariants)."""

from __future__ import annotations

import pytest

from vllm_patch.testing.harness import EOS, Harness
from vllm_patch.v1.core.sched.scheduler import invariants as inv

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


def test_raises_with_request_and_state(patched, native):
    h = Harness("xgrammar", num_spec_tokens=3)
    inv.instrument(h.scheduler)
    inv.set_mode(h.scheduler, "raise")
    if patched or "G2" in native:
        _post_terminal_run(h)  # holds
        h.drain()
        inv.checker(h.scheduler).check_idle()
        return
    with pytest.raises(inv.InvariantViolation) as ei:
        _post_terminal_run(h)
    e = ei.value
    # Stock commits c (72), the token after the terminal EOS: a b EOS c.
    assert (e.invariant, e.request_id) == ("post_terminal", "r0")
    assert "token 72 committed at output position 3" in e.detail
    assert e.state["output_token_ids"] == [70, 71, EOS, 72]
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


def _serve_and_corrupt(h: Harness):
    """Serving mode; a request whose placeholders go negative for three
    steps: one violation (once per request and invariant)."""
    from vllm_patch.testing.harness import fake_runner_output

    inv.instrument(h.scheduler)
    inv.set_mode(h.scheduler, "serve")
    rid = h.add_request([70, 71], max_tokens=4)
    h.step({rid: [h.tok("a")]})
    h.request(rid).num_output_placeholders = -2
    outputs = []
    for _ in range(2):
        so = h.schedule()
        h.grammar_bitmask(so)
        outputs.append(h.scheduler.update_from_output(
            so, fake_runner_output(so, {rid: [h.tok("a")]})))
    return rid, outputs


def _field_applied() -> bool:
    from vllm_patch import patching
    from vllm_patch.v1.metrics.stats.invariants_field import FIELD_PATCH

    o = patching.REGISTRY.outcomes.get(FIELD_PATCH)
    return o is not None and o.state is patching.State.APPLIED


def test_serving_counts_on_prometheus_and_logs_once(caplog):
    """Serving mode counts each (request, invariant) once on
    vllm_patch_invariant_violations_total and logs it once: through the
    step's SchedulerStats and the frontend's Prometheus logger when the
    stats field is patched in (checker on), else directly."""
    from prometheus_client import REGISTRY

    from vllm_patch.v1.metrics import loggers
    from vllm_patch.v1.metrics.stats.invariants_field import INVARIANT_FIELD

    name = "vllm_patch_invariant_violations_total"
    before = REGISTRY.get_sample_value(name, {"invariant": "placeholders"}) or 0
    _, outputs = _serve_and_corrupt(Harness("xgrammar"))
    carried = [getattr(eco.scheduler_stats, INVARIANT_FIELD, None)
               for out in outputs for eco in out.values()
               if eco.scheduler_stats is not None]
    if _field_applied():
        assert carried == [{"placeholders": 1}, None]
        for c in carried:  # what the frontend's logger does with them
            loggers.count(c)
    else:
        assert not any(carried)
    after = REGISTRY.get_sample_value(name, {"invariant": "placeholders"})
    assert after == before + 1  # once per request and invariant
    assert sum("invariant placeholders violated" in r.getMessage()
               for r in caplog.records) == 1


def test_violation_counts_reach_frontend_prometheus(patched):
    """The plumbing a multiprocess engine uses: the count put on the step's
    SchedulerStats in the engine core survives vLLM's msgpack transport
    (EngineCoreOutputs) and vLLM's PrometheusStatLogger.record, patched,
    adds it to vllm_patch_invariant_violations_total on the frontend's
    registry. Stock (nothing applied): no field, the logger adds nothing."""
    from prometheus_client import REGISTRY
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_patch.v1.metrics.stats.invariants_field import INVARIANT_FIELD

    h = Harness("xgrammar")
    _, outputs = _serve_and_corrupt(h)
    eco = next(iter(outputs[0].values()))
    wire = MsgpackEncoder().encode(eco)
    back = MsgpackDecoder(EngineCoreOutputs).decode(wire)
    name = "vllm_patch_invariant_violations_total"
    before = REGISTRY.get_sample_value(name, {"invariant": "placeholders"}) or 0
    PrometheusStatLogger(h.vllm_config, engine_indexes=[0]).record(
        back.scheduler_stats, None, None, 0)
    after = REGISTRY.get_sample_value(name, {"invariant": "placeholders"}) or 0
    if not patched or not _field_applied():
        assert INVARIANT_FIELD not in SchedulerStats.__dataclass_fields__ \
            or INVARIANT_FIELD not in SchedulerStats.__dict__
        assert after == before
        return
    assert back.scheduler_stats.__dict__.get(INVARIANT_FIELD) == \
        {"placeholders": 1}
    assert after == before + 1
    # Stats without violations (every other step) carry None and count 0.
    quiet = MsgpackDecoder(EngineCoreOutputs).decode(
        MsgpackEncoder().encode(next(iter(outputs[1].values()))))
    assert getattr(quiet.scheduler_stats, INVARIANT_FIELD) is None


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


def test_detects_double_free_and_referenced_block_at_idle(patched):
    """Every block is freed exactly once: a second free of a block (its
    ref_cnt already 0) is double_free; a block still referenced at idle
    is idle_pool even when the free count looks right."""
    h = Harness("xgrammar")
    c = inv.instrument(h.scheduler)
    got = []
    inv.set_mode(h.scheduler, "record", got.append)
    pool = h.scheduler.kv_cache_manager.block_pool
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    assert got == []
    pool.free_blocks(blocks[:1])  # freed twice
    assert [v.invariant for v in got] == ["double_free"]
    assert blocks[0].ref_cnt == -1  # record mode lets the free happen
    blocks[0].ref_cnt = 0  # repair the pool for the next part
    got.clear()
    c.reported.clear()
    # The same block twice in one call with one reference: also double.
    b = pool.get_new_blocks(1)
    pool.free_blocks(b + b)
    assert [v.invariant for v in got] == ["double_free"]
    got.clear()
    c.reported.clear()
    blk = pool.blocks[1] if not pool.blocks[1].is_null else pool.blocks[2]
    blk.ref_cnt = 1  # referenced, yet (wrongly) still in the free queue
    c.check_idle()
    assert [v.invariant for v in got] == ["idle_pool"]
    assert "still referenced" in got[0].detail
    blk.ref_cnt = 0


@pytest.mark.parametrize("backend", ["guidance", "outlines"])
def test_user_stop_token_inside_structured_output_is_not_a_violation(
        backend, patched):
    """A user's stop token the grammar allows mid-output (a letter inside a
    JSON string) ends the request with "stop" where it appears, grammar
    complete or not: vLLM's stop_token_ids, on stock and patched alike
    (guidance and outlines; xgrammar makes the user's stop tokens grammar
    stop tokens, which its bitmask allows only where the grammar may end).
    stop_complete must not flag it (it did: the fuzzer's grammar-aware draft
    source with real JSONSchemaBench schemas found it, patched and stock,
    on 0.32 and 0.33). The exemption is the user's stop token only: the
    same incomplete output with another stop reason is not excused."""
    h = Harness(backend)
    inv.instrument(h.scheduler)
    got: list = []
    inv.set_mode(h.scheduler, "record", got.append)
    z = h.tok("z")
    schema = {"type": "object", "properties": {"a": {"type": "string"}},
              "required": ["a"], "additionalProperties": False}
    rid = h.add_request([70, 71], json=schema, stop_token_ids=[z],
                        ignore_eos=True)
    text = h.encode('{"a":"') + [z]
    for t in text:
        if h.request(rid).is_finished():
            break
        h.step({rid: [t]})
    assert h.request(rid).is_finished()
    assert h.emitted(rid).finish_reason == "stop"
    assert h.request(rid).stop_reason == z
    assert [v.invariant for v in got] == [], got
    h.drain()
    inv.checker(h.scheduler).check_idle()
    # The user's stop token ended it; another reason with the same
    # incomplete output does not excuse it.
    req = h.request(rid)
    assert inv._user_stop(req)
    req.stop_reason = None
    assert not inv._user_stop(req)
