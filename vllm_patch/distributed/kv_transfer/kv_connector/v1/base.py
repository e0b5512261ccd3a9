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
Both wrap the connector object the scheduler holds (connectors override these
methods, so a class-level patch on the base would not see the calls); they
are registry patches like the rest, installed by `wrap_connector`.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from vllm_patch import patching as registry
from vllm_patch.audited import pin
from vllm_patch.patching import Patch

logger = init_logger(__name__)

MARK = "_vllm_patch_kv_overlap"          # on the Request: lookup|loading|stock
STATS = "_vllm_patch_kv_overlap_stats"    # on the scheduler: counters


def _stats(sched: Any) -> dict[str, int]:
    st = sched.__dict__.get(STATS)
    if st is None:
        st = sched.__dict__[STATS] = {"overlapped": 0, "fallback": 0,
                                      "kv_before_grammar": 0, "grammar_wait_net": 0}
    return st


def _make_matched(original: Any, sched: Any) -> Any:
    def get_num_new_matched_tokens(request, num_computed_tokens, *a, **kw):
        n, load_async = original(request, num_computed_tokens, *a, **kw)
        if getattr(request, MARK, None) == "lookup":
            if n is not None and n > 0 and load_async:
                setattr(request, MARK, "loading")
                _stats(sched)["overlapped"] += 1
                # No varying arguments: *_once logs once per message+args.
                logger.info_once(
                    "vllm_patch G4: remote KV loads now start while the "
                    "request's grammar compiles")
            else:
                # Not an async pull: nothing allocated yet; wait for the
                # grammar the stock way.
                setattr(request, MARK, "stock")
                _stats(sched)["fallback"] += 1
                return None, False
        return n, load_async

    return get_num_new_matched_tokens


def _make_after_alloc(original: Any, sched: Any) -> Any:
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
        return original(request, blocks, num_external_tokens, *a, **kw)

    return update_state_after_alloc


MATCHED_PATCH = "g4-connector-lookup-async-only"
AFTER_ALLOC_PATCH = "g4-connector-grammar-wait-net"
_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1."
_COMMON = dict(guarantee="G4", versions=("0.32", "0.33"), per_instance=True,
               upstream="no upstream PR yet (decode-side KV load waits for "
                        "grammar compilation)",
               remove_when="vLLM starts the remote KV pull before the grammar "
                           "is ready")


def wrap_connector(sched: Any, connector: Any) -> bool:
    """Install both connector-side patches on the scheduler's connector
    (idempotent); False if they are not applied (then the scheduler side
    must keep the stock order)."""
    return (registry.wrap_instance(MATCHED_PATCH, connector, sched)
            and registry.wrap_instance(AFTER_ALLOC_PATCH, connector, sched))


PATCHES: list[Patch] = [
    Patch(
        name=MATCHED_PATCH,
        target=_BASE + "get_num_new_matched_tokens",
        signature=("self", "request", "num_computed_tokens"),
        make=_make_matched,
        why="a lookup started before the grammar is ready must not allocate "
            "blocks for a synchronous load (the request would run first)",
        how="per scheduler-side connector object: keep the lookup of a "
            "request marked by g4-kv-load-during-compile only when it is an "
            "async load of > 0 tokens, else return (None, False) so stock "
            "schedule() skips the request before allocating",
        pins=(pin("vllm.v1.core.sched.scheduler:Scheduler.schedule",
                  "a None from get_num_new_matched_tokens skips the request "
                  "for this step before any block is allocated (the lookup "
                  "is asked again later); an async load of > 0 tokens parks "
                  "it in WAITING_FOR_REMOTE_KVS without scheduling it"),),
        **_COMMON,
    ),
    Patch(
        name=AFTER_ALLOC_PATCH,
        target=_BASE + "update_state_after_alloc",
        signature=("self", "request", "blocks", "num_external_tokens"),
        make=_make_after_alloc,
        why="safety net: a marked request scheduled without the async load "
            "must not be scheduled before its grammar is ready",
        how="per scheduler-side connector object: such a request waits for "
            "its grammar future before the stock method runs",
        pins=(pin("vllm.v1.structured_output.request:StructuredOutputRequest"
                  "._check_grammar_completion",
                  "a compiling grammar is a Future in _grammar (waited on "
                  "here); a failed compile is reported by stock code"),),
        **_COMMON,
    ),
]
