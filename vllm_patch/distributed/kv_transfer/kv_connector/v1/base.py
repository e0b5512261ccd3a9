"""G4 (gap F), connector side, for vllm.distributed.kv_transfer.kv_connector.v1.base:
the decode-side lookup of a request whose grammar still compiles keeps only
an async remote load; the scheduler side is
`vllm_patch.v1.core.sched.scheduler.g4_kv_overlap`.

`get_num_new_matched_tokens` (wrapped per connector instance) keeps a marked
lookup only when it is an async load of > 0 tokens; anything else returns
`(None, False)` ("cannot decide yet"), so stock `schedule()` skips the
request before allocating and it falls back to the stock order.
`update_state_after_alloc` is the safety net: a marked request scheduled
without the async load waits for its grammar before the step's bitmask.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm_patch")

MARK = "_vllm_patch_kv_overlap"          # on the Request: lookup|loading|stock
WRAPPED = "_vllm_patch_kv_overlap_wrapped"  # on the connector instance
STATS = "_vllm_patch_kv_overlap_stats"    # on the scheduler: counters


def _stats(sched: Any) -> dict[str, int]:
    st = sched.__dict__.get(STATS)
    if st is None:
        st = sched.__dict__[STATS] = {"overlapped": 0, "fallback": 0,
                                      "kv_before_grammar": 0, "grammar_wait_net": 0}
    return st


def _wrap_connector(sched: Any, connector: Any) -> None:
    if connector is None or getattr(connector, WRAPPED, False):
        return
    original = connector.get_num_new_matched_tokens

    def get_num_new_matched_tokens(request, num_computed_tokens, *a, **kw):
        n, load_async = original(request, num_computed_tokens, *a, **kw)
        if getattr(request, MARK, None) == "lookup":
            if n is not None and n > 0 and load_async:
                setattr(request, MARK, "loading")
                st = _stats(sched)
                st["overlapped"] += 1
                if st["overlapped"] == 1:
                    logger.info("vllm_patch G4: remote KV load of %s (%d tokens) "
                                "requested while its grammar compiles (gap F "
                                "overlap; logged once)", request.request_id, n)
            else:
                # Not an async pull: nothing allocated yet; wait for the
                # grammar the stock way.
                setattr(request, MARK, "stock")
                _stats(sched)["fallback"] += 1
                return None, False
        return n, load_async

    original_alloc = connector.update_state_after_alloc

    def update_state_after_alloc(request, blocks, num_external_tokens, *a, **kw):
        if getattr(request, MARK, None) == "loading" and not num_external_tokens:
            # A stock path cleared the async load after the lookup and is
            # scheduling the request now: it must not run before its grammar.
            setattr(request, MARK, "stock")
            _stats(sched)["grammar_wait_net"] += 1
            so = request.structured_output_request
            fut = getattr(so, "_grammar", None) if so is not None else None
            if hasattr(fut, "result"):
                try:
                    fut.result()
                except Exception:  # noqa: BLE001 - stock code reports it
                    pass
        return original_alloc(request, blocks, num_external_tokens, *a, **kw)

    connector.get_num_new_matched_tokens = get_num_new_matched_tokens
    connector.update_state_after_alloc = update_state_after_alloc
    setattr(connector, WRAPPED, True)
PATCHES: list = []
