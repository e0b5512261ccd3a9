"""The invariant checker judges the patches, not its inputs: a step outside
the model runner's contract (drafts scheduled, no token sampled: vLLM's own
tests/v1/core/test_scheduler.py::test_spec_decoding_stats_empty_output builds
one) leaves stock vLLM's counters inconsistent by itself, so the checker stops
checking that request instead of raising; within the contract it still
raises. Both modes: the inconsistency is stock's (same counters with and
without the patches); the checker is attached by hand in the stock run."""

from __future__ import annotations

import pytest

from vllm_patch.testing.harness import Harness
from vllm_patch.v1.core.sched.scheduler import invariants as inv

pytestmark = pytest.mark.scheduler


def _checked_harness() -> Harness:
    h = Harness("xgrammar", num_spec_tokens=3)
    inv.instrument(h.scheduler)
    inv.set_mode(h.scheduler, "raise")
    return h


def test_no_token_for_scheduled_drafts_is_not_a_violation():
    h = _checked_harness()
    rid = h.add_request([70], max_tokens=16)
    h.step({rid: [0]}, drafts={rid: [1, 2, 3]})
    record = h.step({rid: []})           # 3 drafts scheduled, nothing sampled
    assert record.spec_tokens[rid] == [1, 2, 3]
    req = h.request(rid)
    # vLLM's own counters, stock and patched alike.
    assert (req.num_tokens, req.num_computed_tokens) == (2, 5)
    c = inv.checker(h.scheduler)
    assert "3 draft(s) scheduled" in c.unchecked[rid]
    # The request goes on unchecked; the rest of the scheduler stays checked.
    h.scheduler.finish_requests(rid, _aborted())
    h.drain()
    c.check_idle()


def test_within_the_contract_a_violation_still_raises():
    """Control: the same counters reached on a step that is within the
    contract (a token sampled) raise."""
    h = _checked_harness()
    rid = h.add_request([70], max_tokens=16)
    h.step({rid: [0]}, drafts={rid: [1, 2, 3]})
    so = h.schedule()
    h.grammar_bitmask(so)
    assert so.scheduled_spec_decode_tokens[rid] == [1, 2, 3]
    h.request(rid).num_computed_tokens += 3   # as if drafts stayed counted
    with pytest.raises(inv.InvariantViolation) as ei:
        h.run_model(so, {rid: [1]}, True)
    assert (ei.value.invariant, ei.value.request_id) == ("computed_le_tokens",
                                                         rid)
    assert rid not in inv.checker(h.scheduler).unchecked


def _aborted():
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED
