"""G4 scenarios: a P/D decode instance's scheduler (real Scheduler /
AsyncScheduler, real NixlConnector scheduler role, real xgrammar grammars,
hand-made connector outputs; `vllm_patch.testing.pd_sched`).

- kv-overlap (stock fails, gap F): the remote KV load is requested while the
  grammar compiles, and the request is not scheduled before both are done.
- lifecycle controls (stock holds too): abort while the transfer is pending,
  failed load with kv_load_failure_policy fail / recompute, grammar compile
  failure after the transfer was requested: every block freed exactly once,
  all blocks free at idle.
"""

from __future__ import annotations

from typing import Any, Callable

from vllm_patch.conformance import Scenario


def _idle_violations(h: Any) -> list[str]:
    try:
        h.assert_idle_no_leak()
    except AssertionError as e:
        return [f"not idle / leak: {e}"]
    return []


def _overlap(async_: bool) -> Callable[[], list[str]]:
    def run() -> list[str]:
        from vllm_patch.testing.pd_sched import PDDecodeSched

        v: list[str] = []
        h = PDDecodeSched(async_scheduling=async_)
        rid = h.add_remote_request(prompt_len=40, hold_grammar=True)
        req = h.requests[rid]
        so = h.schedule()
        if rid in so.num_scheduled_tokens:
            v.append("scheduled before its grammar compiled")
        if req.status.name != "WAITING_FOR_REMOTE_KVS":
            v.append(f"KV load not requested while the grammar compiles "
                     f"(status {req.status.name})")
        h.sched.update_from_output(so, h.model_output(so))
        if req.status.name == "WAITING_FOR_REMOTE_KVS":
            h.kv_arrived(rid)
            so = h.schedule()
            if rid in so.num_scheduled_tokens:
                v.append("scheduled after the KV arrived but before the grammar")
            h.sched.update_from_output(so, h.model_output(so))
            h.release_grammar(rid)
        else:
            h.release_grammar(rid)
            for _ in range(3):
                so = h.schedule()
                h.sched.update_from_output(so, h.model_output(so))
            h.kv_arrived(rid)
        h.run_to_idle()
        if h.finish_reason(rid) != "stop":
            v.append(f"finish_reason {h.finish_reason(rid)}")
        return v + _idle_violations(h)

    return run


def _abort() -> list[str]:
    from vllm.v1.request import RequestStatus

    from vllm_patch.testing.pd_sched import PDDecodeSched

    h = PDDecodeSched()
    rid = h.add_remote_request(hold_grammar=False)
    h.wait_grammar(rid)
    for _ in range(20):  # until the load is requested
        so = h.schedule()
        h.sched.update_from_output(so, h.model_output(so))
        if h.requests[rid].status.name == "WAITING_FOR_REMOTE_KVS":
            break
    h.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    h.kv_arrived(rid)
    return _idle_violations(h)


def _failed_load(policy: str) -> Callable[[], list[str]]:
    def run() -> list[str]:
        from vllm_patch.testing.pd_sched import PDDecodeSched

        h = PDDecodeSched(kv_load_failure_policy=policy)
        rid = h.add_remote_request(prompt_len=40, hold_grammar=False)
        h.wait_grammar(rid)
        for _ in range(20):
            so = h.schedule()
            h.sched.update_from_output(so, h.model_output(so))
            if h.requests[rid].status.name == "WAITING_FOR_REMOTE_KVS":
                break
        blocks = h.req_blocks(rid)
        h.kv_arrived(rid, invalid={blocks[1]} if len(blocks) > 1 else set(blocks))
        h.run_to_idle()
        want = "error" if policy == "fail" else "stop"
        v = [] if h.finish_reason(rid) == want else [
            f"finish_reason {h.finish_reason(rid)}, expected {want}"]
        return v + _idle_violations(h)

    return run


def _compile_failure() -> list[str]:
    from vllm_patch.testing.pd_sched import PDDecodeSched

    h = PDDecodeSched()
    rid = h.add_remote_request(hold_grammar=True, grammar_error=True)
    so = h.schedule()
    h.sched.update_from_output(so, h.model_output(so))
    requested = h.requests[rid].status.name == "WAITING_FOR_REMOTE_KVS"
    if requested:  # patched: the KV arrives first, then the compile fails
        h.kv_arrived(rid)
    h.release_grammar(rid)
    if not requested:  # stock: the compile failure is seen before any load
        for _ in range(3):
            h.step()
    h.run_to_idle()
    v = [] if h.finish_reason(rid) == "error" else [
        f"finish_reason {h.finish_reason(rid)}, expected error"]
    return v + _idle_violations(h)


# Stock asks for the remote KV only once the grammar has compiled (gap F).
_STOCK_NO_OVERLAP = ("KV load not requested while the grammar compiles (status "
                     "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)",)

SCENARIOS: list[Scenario] = [
    Scenario("g4-kv-load-overlaps-compile-sync", "G4",
             "decode side requests the remote KV while the grammar compiles (sync)",
             _overlap(False), stock_violations=_STOCK_NO_OVERLAP),
    Scenario("g4-kv-load-overlaps-compile-async", "G4",
             "decode side requests the remote KV while the grammar compiles (async)",
             _overlap(True), stock_violations=_STOCK_NO_OVERLAP),
    Scenario("g4-abort-while-transfer-pending", "G4",
             "abort in WAITING_FOR_REMOTE_KVS: blocks freed once, after the receive",
             _abort, stock_fails=False),
    Scenario("g4-failed-load-fail", "G4",
             "failed load, kv_load_failure_policy=fail: error, blocks freed once",
             _failed_load("fail"), stock_fails=False),
    Scenario("g4-failed-load-recompute", "G4",
             "failed load, kv_load_failure_policy=recompute: recomputed, freed once",
             _failed_load("recompute"), stock_fails=False),
    Scenario("g4-grammar-failure-after-transfer", "G4",
             "grammar compile fails after the transfer was requested: freed once",
             _compile_failure, stock_fails=False),
]
