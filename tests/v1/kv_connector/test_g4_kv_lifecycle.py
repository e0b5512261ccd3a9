"""G4 at the scheduler tier (vLLM 0.32 and 0.33): a P/D decode instance's
scheduler with the real NixlConnector (scheduler role), real xgrammar
grammars whose compile future the test holds back, hand-made model runner
outputs (finished_recving / invalid_block_ids).

- gap F overlap: patched, the remote KV load is requested (blocks allocated,
  request in WAITING_FOR_REMOTE_KVS, listed in the connector metadata) while
  the grammar is still compiling; the request is never scheduled before both
  are done. Stock: nothing is requested until the grammar is ready.
- lifecycle, every block freed exactly once, idle = all blocks free:
  abort while the transfer is pending; failed load with
  kv_load_failure_policy fail / recompute; grammar compile failure after the
  transfer was requested; a normal request run to completion.

    python -m pytest tests/v1/kv_connector -q
    VLLM_PATCH_DISABLE=1 python -m pytest tests/v1/kv_connector -q
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=/root/.cache/vllm-patch/vllm-0.33.0 \
        python -m pytest tests/v1/kv_connector -q
"""

from __future__ import annotations

import pytest

from vllm_patch.testing.pd_sched import PDDecodeSched

pytestmark = pytest.mark.scheduler


def _status(req):
    return req.status.name


def _recv_ids(so):
    meta = getattr(so, "kv_connector_metadata", None)
    return set(getattr(meta, "reqs_to_recv", {}) or {})


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_kv_load_overlaps_grammar_compile(patched, native, async_scheduling):
    h = PDDecodeSched(async_scheduling=async_scheduling)
    rid = h.add_remote_request(prompt_len=40, hold_grammar=True)
    req = h.requests[rid]

    so = h.schedule()  # grammar still compiling
    assert rid not in so.num_scheduled_tokens
    if not (patched or "G4" in native):  # a build carrying G4: its own code
        # stock: the KV pull waits for the grammar (gap F)
        assert _status(req) == "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"
        assert h.held_blocks() == 0 and rid not in _recv_ids(so)
        h.release_grammar(rid)
        h.sched.update_from_output(so, h.model_output(so))
        so = h.schedule()
        assert _status(req) == "WAITING_FOR_REMOTE_KVS" and rid in _recv_ids(so)
        h.sched.update_from_output(so, h.model_output(so))
        h.kv_arrived(rid)
        h.run_to_idle()
        assert h.finish_reason(rid) == "stop"
        h.assert_idle_no_leak()
        return

    assert _status(req) == "WAITING_FOR_REMOTE_KVS", _status(req)
    assert rid in _recv_ids(so), "load not requested while compiling"
    assert h.held_blocks() == 3  # ceil(40 / 16)
    h.sched.update_from_output(so, h.model_output(so))

    # KV arrives first: still not scheduled (grammar pending)
    so = h.kv_arrived(rid)
    so = h.schedule()
    assert rid not in so.num_scheduled_tokens
    assert _status(req) == "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"
    assert req.num_computed_tokens == 39  # last prompt token recomputed locally
    h.sched.update_from_output(so, h.model_output(so))

    # grammar ready -> scheduled for the one recomputed token, with a grammar
    h.release_grammar(rid)
    so = h.schedule()
    assert so.num_scheduled_tokens.get(rid) == 1
    assert req.structured_output_request.grammar is not None
    bm = h.sched.get_grammar_bitmask(so)
    assert bm is not None
    h.sched.update_from_output(so, h.model_output(so))
    h.run_to_idle()
    assert h.finish_reason(rid) == "stop"
    h.assert_idle_no_leak()


def test_grammar_ready_before_kv(patched):
    h = PDDecodeSched()
    rid = h.add_remote_request(hold_grammar=True)
    so = h.schedule()
    h.release_grammar(rid)  # grammar finishes while the load runs
    h.sched.update_from_output(so, h.model_output(so))
    so = h.schedule()
    assert rid not in so.num_scheduled_tokens
    h.sched.update_from_output(so, h.model_output(so))
    h.kv_arrived(rid)
    h.run_to_idle()
    assert h.finish_reason(rid) == "stop"
    h.assert_idle_no_leak()


def _to_remote_wait(h, rid: str, patched: bool) -> None:
    """First step(s) of a remote request whose grammar is held: patched
    starts the KV load at once (gap F); stock needs the grammar first."""
    so = h.schedule()
    h.sched.update_from_output(so, h.model_output(so))
    if not patched:
        h.release_grammar(rid)
        so = h.schedule()
        h.sched.update_from_output(so, h.model_output(so))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_while_transfer_pending(patched, async_scheduling):
    from vllm.v1.request import RequestStatus

    h = PDDecodeSched(async_scheduling=async_scheduling)
    rid = h.add_remote_request(hold_grammar=True)
    _to_remote_wait(h, rid, patched)
    assert _status(h.requests[rid]) == "WAITING_FOR_REMOTE_KVS"
    held = h.held_blocks()
    assert held > 0
    h.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    # blocks stay pinned until the worker reports the receive finished
    assert h.held_blocks() == held
    so = h.kv_arrived(rid)
    if patched:
        h.release_grammar(rid)
    h.assert_idle_no_leak()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_load(patched, policy, async_scheduling):
    h = PDDecodeSched(kv_load_failure_policy=policy, async_scheduling=async_scheduling)
    rid = h.add_remote_request(prompt_len=40, hold_grammar=True)
    _to_remote_wait(h, rid, patched)
    blocks = h.req_blocks(rid)
    assert blocks
    h.kv_arrived(rid, invalid={blocks[1]})
    if patched:
        h.release_grammar(rid)
    h.run_to_idle()
    if policy == "fail":
        assert h.finish_reason(rid) == "error"
    else:
        assert h.finish_reason(rid) == "stop"
    h.assert_idle_no_leak()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_grammar_compile_failure_after_transfer_requested(patched, native,
                                                        async_scheduling):
    h = PDDecodeSched(async_scheduling=async_scheduling)
    rid = h.add_remote_request(hold_grammar=True, grammar_error=True)
    so = h.schedule()
    h.sched.update_from_output(so, h.model_output(so))
    if patched or "G4" in native:
        assert _status(h.requests[rid]) == "WAITING_FOR_REMOTE_KVS"
        h.kv_arrived(rid)
        h.release_grammar(rid)  # compile fails after the KV arrived
    else:
        h.release_grammar(rid)
    h.run_to_idle()
    assert h.finish_reason(rid) == "error"
    h.assert_idle_no_leak()


def test_no_remote_params_is_stock(patched):
    """A structured request without do_remote_prefill is not touched."""
    h = PDDecodeSched()
    rid = h.add_remote_request(hold_grammar=True, remote=False)
    so = h.schedule()
    assert _status(h.requests[rid]) == "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"
    assert h.held_blocks() == 0
    h.sched.update_from_output(so, h.model_output(so))
    h.release_grammar(rid)
    h.run_to_idle()
    assert h.finish_reason(rid) == "stop"
    h.assert_idle_no_leak()


@pytest.mark.timeout(120)  # before the fix the scheduler blocked on the held grammar
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_request_waits_for_its_grammar(patched, async_scheduling):
    """A request that skips reading the prefix cache (prompt logprobs): stock
    schedule() turns the connector's "cannot decide yet" into "nothing to
    load", so the early lookup must not be started for it; it keeps the stock
    order and is never scheduled before its grammar is ready."""
    h = PDDecodeSched(async_scheduling=async_scheduling)
    rid = h.add_remote_request(prompt_len=40, hold_grammar=True, prompt_logprobs=1)
    req = h.requests[rid]
    assert req.skip_reading_prefix_cache
    for _ in range(3):
        so = h.schedule()
        assert rid not in so.num_scheduled_tokens, "scheduled before its grammar"
        assert _status(req) == "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"
        h.sched.update_from_output(so, h.model_output(so))
    h.release_grammar(rid)
    h.run_to_idle()
    assert h.finish_reason(rid) == "stop"
    h.assert_idle_no_leak()
