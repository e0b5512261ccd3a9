"""G2 for vllm.v1.core.sched.scheduler: nothing past the grammar's end is committed.

Hook: `Scheduler._update_request_with_output`, the one place where a step's
sampled tokens are appended to the request (and thereby hashed into blocks,
cached, fed to the grammar, given logprobs and emitted: all of that reads the
list this method returns). The wrapper decides, with the grammar, how many of
the returned tokens may be committed BEFORE the stock append loop runs:

1. `grammar_cut` splits off the reasoning part exactly as stock does
   (`StructuredOutputManager._get_constraint_bounds`, uncommitted form, as
   `validate_tokens` uses it), then asks the grammar for the longest valid
   prefix of the rest (`validate_tokens`: non-advancing, walks token by token
   and stops after a terminal token or before the first invalid one). The
   terminal can only be the last validated token; it is confirmed by an
   accept + `is_terminated()` probe that is rolled back (skipped when the
   token is not one of the backend's stop tokens). No advance ever exceeds
   the step, so outlines' `max_rollback = k` is respected (an
   accept-everything-then-rollback probe of a k+1-token step raises there).
2. The dropped tail is deleted from the runner's list in place and
   `num_computed_tokens` / `num_output_placeholders` are rolled back by the
   dropped count (what stock 0.33 does for a stop trim), unless the output is
   stale (preempted request: counters were already reset).
3. The stock method appends the kept prefix and runs `check_stop` (stock stop
   precedence: EOS, stop tokens, length inside the kept prefix are unchanged).
4. If stock did not stop, the request finishes in the same pass:
   FINISHED_STOPPED (stop_reason = terminal id unless it is the tokenizer EOS)
   on termination, FINISHED_ERROR + non-resumable on rejection (one log line).

The settings (`VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION`) are read at call time,
only when a grammar terminal is found (rare), so a test can flip them without
re-applying and the hot path pays nothing for them. With the flag off,
termination is left to stock (post-terminal tokens behave as in stock); the
rejection trim stays.

0.32 differences, handled by a separate series of the same patch:
- stock 0.32 trims at a stop but does not roll back `num_computed_tokens`;
  the 0.32 wrapper does (and, under async scheduling, also the placeholders
  of the trimmed tokens, so 0.32's `AsyncScheduler` caches the same blocks).
  This applies to every request (G2: "any stop trim"); emitted output of
  unstructured requests is unchanged.
- 0.32's `AsyncScheduler._update_request_with_output` calls `super()` without
  `is_stale`; `vllm_patch.v1.core.sched.async_scheduler` passes it through.

Spec-decode stats: `make_spec_decoding_stats` caps accepted at the real
(non-invalidated) drafts; the per-request metrics are capped in
`vllm_patch.v1.metrics.stats`.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_patch import envs
from vllm_patch.patching import Patch

logger = logging.getLogger("vllm_patch")

TERMINATED = "terminated"
REJECTED = "rejected"

# Attribute set by the 0.32 AsyncScheduler wrapper around its super() call.
STALE_ATTR = "_vllm_patch_is_stale"
_EOS_ATTR = "_vllm_patch_tokenizer_eos"
_STOPS_ATTR = "_vllm_patch_stop_ids"

UPSTREAM = ("SGLang PR #24082 (spec decoding with grammar in disagg) and "
            "follow-up #28682 (decide at the accepted-length point)")


def _stop_candidates(grammar: Any) -> frozenset[int] | None:
    """Token ids that can terminate `grammar`, or None if unknown backend."""
    cached = grammar.__dict__.get(_STOPS_ATTR)
    if cached is not None:
        return cached
    stops: frozenset[int] | None = None
    matcher = getattr(grammar, "matcher", None)           # xgrammar
    if matcher is not None and hasattr(matcher, "stop_token_ids"):
        stops = frozenset(int(t) for t in matcher.stop_token_ids)
    elif hasattr(grammar, "ll_tokenizer"):                  # guidance
        stops = frozenset([int(grammar.ll_tokenizer.eos_token)])
    elif hasattr(grammar, "guide") and hasattr(grammar, "eos_token_id"):  # outlines
        stops = frozenset([int(grammar.eos_token_id)])
    if stops is not None:
        grammar.__dict__[_STOPS_ATTR] = stops
    return stops


def _terminates(grammar: Any, request_id: str, valid: list[int]) -> bool:
    """Does accepting `valid` (a validated prefix) terminate the grammar?
    Only the last token can be the terminal (validate_tokens stops after
    it). Probe by accepting and rolling back."""
    stops = _stop_candidates(grammar)
    if stops is not None and valid[-1] not in stops:
        return False
    if not grammar.accept_tokens(request_id, valid):
        # validate said valid; defensive: treat as not terminated.
        return False
    try:
        return bool(grammar.is_terminated())
    finally:
        grammar.rollback(len(valid))


def _stopped_awaiting_eos(grammar: Any, token: int) -> bool:
    """guidance: once the grammar is complete, llguidance's matcher is
    "stopped" (only EOS allowed) and `validate_tokens` returns [] for
    everything, EOS included; `accept_tokens` then treats EOS as the
    terminal. Mirror that instead of calling EOS a rejection."""
    matcher = getattr(grammar, "ll_matcher", None)
    return (matcher is not None and matcher.is_stopped()
            and token == grammar.ll_tokenizer.eos_token)


def grammar_cut(manager: Any, request: Any, tokens: list[int]
                ) -> tuple[int, str | None, int | None]:
    """How many of `tokens` may be committed: (cut, reason, rejected_token).

    reason is TERMINATED (cut is just after the terminal token, which may be
    the last token: nothing dropped, the request still finishes), REJECTED
    (cut is before the first grammar-invalid token), or None (all kept).
    """
    n = len(tokens)
    so_req = request.structured_output_request
    grammar = so_req.grammar if so_req is not None else None
    if grammar is None or not n:
        return n, None, None
    grammar_start = manager._get_constraint_bounds(request, tokens)[0]
    if grammar_start >= n:
        return n, None, None  # every token is reasoning (or ends it)
    if grammar.is_terminated():
        return grammar_start, TERMINATED, None
    tail = tokens[grammar_start:]
    valid = grammar.validate_tokens(tail)
    m = len(valid)
    if m and _terminates(grammar, request.request_id, valid):
        return grammar_start + m, TERMINATED, None
    if m < len(tail):
        if not m and _stopped_awaiting_eos(grammar, tail[0]):
            return grammar_start + 1, TERMINATED, None
        return grammar_start + m, REJECTED, tail[m]
    return n, None, None


def _tokenizer_eos(scheduler: Any) -> int | None:
    eos = scheduler.__dict__.get(_EOS_ATTR, -1)
    if eos == -1:
        try:
            eos = scheduler.structured_output_manager.tokenizer.eos_token_id
        except Exception:  # noqa: BLE001 - no tokenizer: no EOS special case
            eos = None
        scheduler.__dict__[_EOS_ATTR] = eos
    return eos


def _finish(scheduler: Any, request: Any, kept: list[int], reason: str,
            rejected: int | None) -> None:
    from vllm.v1.request import RequestStatus

    if reason == TERMINATED:
        request.status = RequestStatus.FINISHED_STOPPED
        last = kept[-1] if kept else None
        if last is not None and last != _tokenizer_eos(scheduler):
            request.stop_reason = last
        else:
            request.stop_reason = None
    else:
        request.status = RequestStatus.FINISHED_ERROR
        request.resumable = False
        logger.error(
            "vllm_patch G2: request %s: grammar rejected token %s after %d "
            "valid token(s) of the step; finishing with FINISHED_ERROR",
            request.request_id, rejected, len(kept),
        )


def _make_update(series: str):
    def make(original):
        def _update_request_with_output(self, request, new_token_ids,
                                        is_stale=False):
            stale = is_stale or self.__dict__.get(STALE_ATTR, False)
            reason = rejected = None
            if request.use_structured_output:
                cut, reason, rejected = grammar_cut(
                    self.structured_output_manager, request, new_token_ids)
                if reason == TERMINATED and \
                        not envs.settings().stop_on_grammar_termination:
                    cut, reason = len(new_token_ids), None  # stock termination
                dropped = len(new_token_ids) - cut
                if dropped:
                    if not stale:
                        request.num_computed_tokens -= dropped
                        if request.num_output_placeholders > 0:
                            request.num_output_placeholders -= dropped
                    del new_token_ids[cut:]
            if series == "0.32":
                returned = len(new_token_ids)
                kept, stopped = original(self, request, new_token_ids, is_stale)
                trimmed = returned - len(kept)
                if stopped and trimmed and not stale:
                    # As 0.33 does: num_computed_tokens covers all kept tokens
                    # but the last one; placeholders of trimmed tokens resolve.
                    request.num_computed_tokens -= trimmed
                    if request.num_output_placeholders > 0:
                        request.num_output_placeholders -= trimmed
            else:
                kept, stopped = original(self, request, new_token_ids, is_stale)
            if reason is not None and not stopped:
                _finish(self, request, kept, reason, rejected)
                stopped = True
            return kept, stopped

        return _update_request_with_output

    return make


def _make_spec_stats(original):
    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens,
                                 num_accepted_tokens, num_invalid_spec_tokens,
                                 request_id):
        real = num_draft_tokens
        if num_invalid_spec_tokens:
            real -= num_invalid_spec_tokens.get(request_id, 0)
        if num_accepted_tokens > real:
            num_accepted_tokens = max(real, 0)
        return original(self, spec_decoding_stats, num_draft_tokens,
                        num_accepted_tokens, num_invalid_spec_tokens, request_id)

    return make_spec_decoding_stats


_UPDATE_SIG = ("self", "request", "new_token_ids", "is_stale")
_TARGET = "vllm.v1.core.sched.scheduler:Scheduler._update_request_with_output"
_HOW = ("wrap _update_request_with_output: validate the step's tokens against "
        "the grammar (after the reasoning split) before the stock append loop, "
        "delete the tokens after the terminal / from the first rejected token "
        "in place, roll back num_computed_tokens and num_output_placeholders "
        "by the dropped count, then finish the request in the same pass "
        "(FINISHED_STOPPED / FINISHED_ERROR)")
_WHY = ("stock appends, hashes, caches, emits (with logprobs) and keeps "
        "generating tokens after the grammar's terminal state when the "
        "grammar's stop set differs from check_stop's (ignore_eos, "
        "generation-config EOS, guidance/outlines); emits rejected tokens "
        "before finishing with an error (rollback audit P1-P7)")

PATCHES: list[Patch] = [
    Patch(
        name="g2-commit-cut-0.33",
        guarantee="G2",
        target=_TARGET,
        versions=("0.33",),
        signature=_UPDATE_SIG,
        make=_make_update("0.33"),
        why=_WHY,
        how=_HOW,
        upstream=UPSTREAM,
        remove_when=("vLLM treats grammar termination as a stop condition "
                     "and trims at the accepted-length decision"),
    ),
    Patch(
        name="g2-commit-cut-0.32",
        guarantee="G2",
        target=_TARGET,
        versions=("0.32",),
        signature=_UPDATE_SIG,
        make=_make_update("0.32"),
        why=_WHY + "; 0.32 also leaves num_computed_tokens past a stop trim",
        how=_HOW + "; additionally rolls back num_computed_tokens (and async "
                   "placeholders) for any stop trim, as 0.33 does",
        upstream=UPSTREAM + "; vLLM 0.33 stop-trim rollback "
                            "(scheduler.py:2758-2763)",
        remove_when="0.32 support is dropped",
    ),
    Patch(
        name="g2-spec-stats-cap",
        guarantee="G2",
        target="vllm.v1.core.sched.scheduler:Scheduler.make_spec_decoding_stats",
        versions=("0.32", "0.33"),
        signature=("self", "spec_decoding_stats", "num_draft_tokens",
                   "num_accepted_tokens", "num_invalid_spec_tokens",
                   "request_id"),
        make=_make_spec_stats,
        why=("stock subtracts grammar-invalidated drafts from the proposed "
             "count but not from the accepted count: '2 drafts, 3 accepted'"),
        how="cap accepted at num_draft_tokens - num_invalid_spec_tokens",
        upstream=UPSTREAM,
        remove_when="vLLM caps accepted drafts at the grammar-valid drafts",
    ),
]
