"""G4 (gap F) for vllm.v1.core.sched.scheduler: on a P/D decode instance,
start the remote KV load while the request's grammar compiles.

Stock (0.32 and 0.33): `Scheduler._handle_blocked_waiting_request` keeps a
structured-output request in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR until its
grammar future is done, and only then does `schedule()` ask the connector
for the remote KV (`get_num_new_matched_tokens`), allocate the blocks and
start the load (disagg audit, gap F). Compile time and transfer time add up.

Patched, for a request that carries `kv_transfer_params.do_remote_prefill`
(NixlConnector-style async pull) and whose grammar is still compiling:

1. `_handle_blocked_waiting_request` lets it through to the connector lookup
   while its status stays WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR (mark
   "lookup");
2. the connector's `get_num_new_matched_tokens` (wrapped per scheduler
   instance) keeps the lookup only when it is an async load of > 0 tokens
   (mark "loading"); anything else returns `(None, False)`, which stock
   `schedule()` treats as "cannot decide yet: skip this step" before any
   block is allocated, and the request falls back to the stock order (mark
   "stock");
3. stock code allocates, calls `update_state_after_alloc`, and parks the
   request in WAITING_FOR_REMOTE_KVS: the load runs while the grammar
   compiles;
4. when the KV has arrived, stock promotes it to WAITING; if the grammar is
   still compiling (or failed) the wrapper puts it back into
   WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, so it is never scheduled before
   both are done, and a compile failure is reported by stock code
   (FINISHED_ERROR, blocks freed by `_free_request`).

Safety net (the connector's `update_state_after_alloc`, wrapped per object
with the lookup: vllm_patch.distributed.kv_transfer.kv_connector.v1.base): a marked
request that stock code schedules without the async load (a path that
cleared `load_kv_async` after the lookup) blocks on its grammar future
before the step's bitmask is built.
Blocks are allocated and freed only by stock code, so abort / failed load
(both `kv_load_failure_policy` values) / compile failure go through the
same freeing paths as stock.
"""

from __future__ import annotations

from typing import Any

from vllm_patch.distributed.kv_transfer.kv_connector.v1.base import (
    MARK,
    _stats,
    wrap_connector,
)
from vllm_patch.audited import pin
from vllm_patch.patching import Patch

UPSTREAM = ("vLLM disagg audit gap F (../shared/research/vllm-disagg-audit.md); "
            "no upstream PR yet")
_SCHED = "vllm.v1.core.sched.scheduler:Scheduler."
_BOTH = ("0.32", "0.33")


def _status():
    from vllm.v1.request import RequestStatus

    return RequestStatus


def _wants_remote_prefill(request: Any) -> bool:
    params = getattr(request, "kv_transfer_params", None)
    return bool(isinstance(params, dict) and params.get("do_remote_prefill"))


def _grammar_state(request: Any) -> str:
    """ready | failed | pending"""
    so = request.structured_output_request
    if so is None:
        return "ready"
    g = so.grammar  # resolves a done future
    if g is None:
        return "pending"
    return "failed" if isinstance(g, Exception) else "ready"


def _make_handle_blocked(original):
    def _handle_blocked_waiting_request(self, request):
        RS = _status()
        mark = getattr(request, MARK, None)
        if (mark in ("lookup", "loading")
                and request.status == RS.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
                and request.num_computed_tokens == 0):
            # the lookup never reached the connector, or the request was
            # skipped (budget / blocks) before allocation: try again
            setattr(request, MARK, None)
            mark = None
        if (mark is None
                and request.status == RS.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
                and getattr(self, "connector", None) is not None
                and request.num_computed_tokens == 0
                and _wants_remote_prefill(request)
                # stock schedule() turns "cannot decide yet" into "nothing
                # to load" for such a request: keep the stock order for it
                and not getattr(request, "skip_reading_prefix_cache", False)
                and _grammar_state(request) == "pending"):
            if wrap_connector(self, self.connector):
                setattr(request, MARK, "lookup")
                return True  # status stays WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        ok = original(self, request)
        if (ok and mark == "loading"
                and request.status in (RS.WAITING, RS.PREEMPTED)
                and _grammar_state(request) != "ready"):
            # KV arrived first: wait for the grammar (a failed compile is
            # recorded by the stock GRAMMAR branch on the next step).
            request.status = RS.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            _stats(self)["kv_before_grammar"] += 1
            setattr(request, MARK, "stock")
            return False
        if ok and mark == "loading":
            setattr(request, MARK, "stock")
        return ok

    return _handle_blocked_waiting_request


PATCHES: list[Patch] = [
    Patch(
        name="g4-kv-load-during-compile",
        guarantee="G4",
        target=_SCHED + "_handle_blocked_waiting_request",
        versions=_BOTH,
        signature=("self", "request"),
        make=_make_handle_blocked,
        why=("gap F: the decode side asks the connector for the remote KV only "
             "after the grammar compiled, so compile time adds to the transfer"),
        how=("let a do_remote_prefill request with a compiling grammar reach the "
             "connector lookup (async loads only); after the KV arrived, hold it "
             "in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR until the grammar is done"),
        upstream=UPSTREAM,
        remove_when="vLLM starts the remote KV pull before the grammar is ready",
        pins=(
            pin(_SCHED + "schedule",
                "waiting loop: once _handle_blocked_waiting_request returns "
                "True it never reads the status (WAITING_FOR_STRUCTURED_OUTPUT"
                "_GRAMMAR stays) before the connector lookup of a request with "
                "num_computed_tokens == 0; a None from get_num_new_matched_"
                "tokens skips the request before any block is allocated; an "
                "async load allocates, calls update_state_after_alloc and "
                "parks the request in WAITING_FOR_REMOTE_KVS"),
            pin(_SCHED + "_handle_blocked_waiting_request",
                "WAITING_FOR_REMOTE_KVS: False until the load finished, then "
                "WAITING (PREEMPTED if preempted before); WAITING_FOR_"
                "STRUCTURED_OUTPUT_GRAMMAR: False while the grammar is None, "
                "records a compile error and returns False, else WAITING"),
            pin("vllm.v1.structured_output.request:StructuredOutputRequest"
                ".grammar.fget",
                "grammar is None while the compile future is pending, the "
                "Exception when the compile failed (_grammar_state)"),
            pin("vllm.v1.structured_output.request:StructuredOutputRequest"
                "._check_grammar_completion",
                "resolves a done future in _grammar in place (an exception "
                "becomes the value); a pending one reads as not ready"),
        ),
    ),
]
