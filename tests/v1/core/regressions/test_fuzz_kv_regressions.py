"""Fuzz episodes kept as regression tests: each reproduced a failure found
by the fuzzer's KV-connector episodes, shrunk by hand to the requests that
matter. Replayed through `vllm_patch.testing.fuzz.run_episode` on the real
scheduler with the NixlConnector scheduler side and the simulated worker.

- pinned_finish_in_flight: a prefill-instance request (do_remote_decode)
  finishes "length" with async steps in flight; the connector keeps it in
  `requests` until its blocks are sent, and the dropped in-flight steps
  leave num_computed_tokens above num_tokens. The checker used to report
  computed_le_tokens for this frozen, finished state; it now bounds a
  finished request by its state at the finish (and flags any later
  growth).
- notify_only_recv: a decode-side request whose grammar fails to compile
  before its load is started (and one aborted in WAITING_FOR_REMOTE_KVS):
  NixlConnector lists it in reqs_to_recv with no blocks only to notify the
  prefill instance; its worker never reports such an entry. The simulated
  worker used to report it (finished_recving for a request the scheduler
  had freed: AssertionError in vLLM).

Patched: no violation at all. Stock: the KV lifecycle properties hold too
(no exception, nothing left after the drain, every block freed exactly
once, pool full at idle); stock's G2 violations are not asserted here.
"""

from __future__ import annotations


import pytest

from vllm_patch.testing import fuzz
from vllm_patch.testing.fuzz import EpisodeSpec, RequestSpec

pytestmark = [pytest.mark.scheduler, pytest.mark.usefixtures("quiet_vllm_patch_log")]

LIFECYCLE = {"exception", "not_drained", "finished_blocks", "idle_pool",
             "double_free"}

EPISODES = {
    "pinned_finish_in_flight": EpisodeSpec(
        backend="outlines", async_scheduling=True, depth=3, num_spec_tokens=3,
        num_blocks=40, requests=[
            RequestSpec(grammar=0, completion=1, prompt=2, ignore_eos=True,
                        max_tokens=14, min_tokens=3, stop=True, logprobs=None,
                        arrive=3, abort_at=4, remote=1, kv_delay=2,
                        kv_fail="request", kv_fail_block=2, hold_grammar=2),
            RequestSpec(grammar=None, completion=1, prompt=4, ignore_eos=False,
                        max_tokens=10, min_tokens=1, stop=False, logprobs=None,
                        arrive=0, abort_at=None),
            RequestSpec(grammar=5, completion=0, prompt=1, ignore_eos=True,
                        max_tokens=15, min_tokens=1, stop=True, logprobs=1,
                        arrive=3, abort_at=None, remote=2, kv_delay=2),
        ], p_bad=0.0, p_accept=0.3, p_follow=0.5, seed=5040, kv="fail"),
    "notify_only_recv": EpisodeSpec(
        backend="outlines", async_scheduling=True, depth=2, num_spec_tokens=3,
        num_blocks=12, requests=[
            RequestSpec(grammar=None, completion=1, prompt=0, ignore_eos=True,
                        max_tokens=4, min_tokens=0, stop=True, logprobs=None,
                        arrive=1, abort_at=None, remote=1, kv_delay=2,
                        kv_fail="request", kv_fail_block=2),
            RequestSpec(grammar=0, completion=1, prompt=4, ignore_eos=False,
                        max_tokens=11, min_tokens=0, stop=False, logprobs=0,
                        arrive=3, abort_at=6, remote=1, kv_delay=0,
                        kv_fail="request", kv_fail_block=3, hold_grammar=0,
                        grammar_error=True),
            RequestSpec(grammar=3, completion=0, prompt=2, ignore_eos=True,
                        max_tokens=9, min_tokens=1, stop=True, logprobs=None,
                        arrive=0, abort_at=None, remote=1, kv_delay=3,
                        kv_fail="nixl", kv_fail_block=1),
        ], p_bad=0.0, p_accept=0.3, p_follow=0.9, seed=705, kv="recompute"),
    "grammar_error_before_load_sync": EpisodeSpec(
        backend="xgrammar", async_scheduling=False, depth=1, num_spec_tokens=0,
        num_blocks=12, requests=[
            RequestSpec(grammar=0, completion=1, prompt=4, ignore_eos=False,
                        max_tokens=11, min_tokens=0, stop=False, logprobs=0,
                        arrive=0, abort_at=None, remote=1, kv_delay=2,
                        kv_fail_block=3, hold_grammar=0, grammar_error=True),
        ], p_bad=0.0, p_accept=0.3, p_follow=0.9, seed=705, kv="recompute"),
}


@pytest.mark.parametrize("name", sorted(EPISODES))
def test_kv_episode(name, patched):
    res = fuzz.run_episode(EPISODES[name])
    got = [(v.invariant, v.request_id, v.detail) for v in res.violations]
    if patched:
        assert got == []
    else:
        assert not (res.properties() & LIFECYCLE), got
    assert res.finished == len(EPISODES[name].requests)
