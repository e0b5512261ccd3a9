"""G2 for vllm.v1.structured_output: stock's post-append grammar accept
becomes a no-op for tokens the G2 scheduler wrapper has already accepted.

`vllm_patch.v1.core.sched.scheduler.g2_commit_cut` advances the grammar once, in front of
the stock append, over exactly the tokens it lets the request keep, and
marks the kept list (`ACCEPTED`, keyed by the list's id). Stock's
`update_from_output` then calls `StructuredOutputManager.accept_tokens`
with that same list object. This wrapper:

- request without structured output: returns True (stock's first line);
- the marked list itself: clears the mark, latches
  `structured_output_request.reasoning_ended = True` (stock does so whenever
  the grammar part of the list is non-empty, which the scheduler guarantees
  when it marks) and returns True, without walking the grammar again;
- anything else (no mark, another list): the stock method unchanged.

If this patch is not applied, the scheduler wrapper sees it (`NAME_ATTR`)
and falls back to its validate-only path, so the grammar is never advanced
twice.
"""

from __future__ import annotations

from vllm_patch.audited import pin
from vllm_patch.patching import Patch
from vllm_patch.v1.core.sched.scheduler.g2_commit_cut import (
    ACCEPT_PATCH,
    ACCEPTED,
    UPSTREAM,
)


def _make_accept(original):
    def accept_tokens(self, request, new_token_ids):
        if not request.use_structured_output:
            return True
        if ACCEPTED and \
                ACCEPTED.pop(id(new_token_ids), None) is new_token_ids:
            request.structured_output_request.reasoning_ended = True
            return True
        return original(self, request, new_token_ids)

    return accept_tokens


PATCHES: list[Patch] = [
    Patch(
        name=ACCEPT_PATCH,
        guarantee="G2",
        target="vllm.v1.structured_output:StructuredOutputManager.accept_tokens",
        versions=("0.32", "0.33"),
        signature=("self", "request", "new_token_ids"),
        make=_make_accept,
        why=("the G2 scheduler wrapper must walk the grammar before the "
             "append to decide the committed length; a second walk in "
             "stock's accept_tokens would double the grammar cost"),
        how=("accept_tokens returns True (latching reasoning_ended) for the "
             "kept list the G2 wrapper marked as already accepted; every "
             "other call is stock"),
        upstream=UPSTREAM,
        remove_when="the G2 scheduler patch is removed",
        pins=(
            pin("vllm.v1.structured_output:StructuredOutputManager.accept_tokens",
                "returns True for a request without structured output and "
                "latches reasoning_ended = True whenever the grammar part of "
                "the list is non-empty: the no-op path reproduces both"),
            pin("vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
                "passes the very list object _update_request_with_output "
                "returned to StructuredOutputManager.accept_tokens, in the "
                "same pass (the ACCEPTED mark is keyed by that list's id); "
                "without this patch the G2 cut validates without advancing"),
        ),
        # G2 holds without it: g2-commit-cut then validates without
        # advancing and stock accepts afterwards (twice the grammar work).
        required=False,
        without="the grammar is walked twice per step (validate-only "
                "fallback)",
    ),
]
