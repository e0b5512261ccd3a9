"""G2 for vllm.v1.core.sched.scheduler: nothing past the grammar's end is committed.

`Scheduler._update_request_with_output` is where a step's tokens are
appended (and so hashed, cached, fed to the grammar, given logprobs and
emitted). Before the stock append, the replacement advances the grammar over
the step's tokens after the reasoning split, in the one walk stock would do
afterwards in `accept_tokens` (`advance_cut`; g2-accept-once turns stock's
later accept of the same list into a no-op), stopping after a terminal token
or before a rejected one. The tail is deleted in place and
`num_computed_tokens` / `num_output_placeholders` roll back by the dropped
count; if stock then stops earlier (max_tokens, a stop token), the grammar is
rolled back to the kept tokens. The request finishes in the same pass:
FINISHED_STOPPED on termination (stop_reason = the terminal id unless it is
the tokenizer EOS), FINISHED_ERROR on rejection. Without g2-accept-once, the
validate-only `grammar_cut` keeps the guarantee at twice the grammar work.

Why inline: one Python frame per request costs about 1 % of the stock
update, the whole budget for unstructured batches, so on the audited stock
source (a fallback pin) the replacement carries the stock body inline;
any other source gets the wrapper `_wrap_update` (same semantics).
0.32 also rolls back `num_computed_tokens` on any stop trim, as 0.33 does.
`make_spec_decoding_stats` caps accepted drafts at the real drafts.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from vllm_patch import envs
from vllm_patch.audited import pin
from vllm_patch.patching import (
    IMPL_ATTR,
    NAME_ATTR,
    Patch,
    Pin,
    source_digest,
    version_series,
    vllm_version,
)

logger = logging.getLogger(__name__)

TERMINATED = "terminated"
REJECTED = "rejected"

# Attribute set by the 0.32 AsyncScheduler wrapper around its super() call.
STALE_ATTR = "_vllm_patch_is_stale"
# Kept token lists whose grammar tokens the wrapper has already accepted,
# keyed by id(list) (the list itself is the value, so the id cannot be
# reused while pending); consumed by g2_accept_once's accept_tokens wrapper
# a few lines later in the same update_from_output. Module-level rather
# than an attribute on the request: a new instance attribute would un-share
# the request's __dict__ and slow every attribute access on it.
ACCEPTED: dict[int, list[int]] = {}
# Name of the StructuredOutputManager.accept_tokens patch the fast path needs.
ACCEPT_PATCH = "g2-accept-once"
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
    it). Probe by accepting and rolling back. (Fallback path only.)"""
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
    """Validate-only fallback (the grammar is not advanced): how many of
    `tokens` may be committed: (cut, reason, rejected_token).

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


# Grammar classes whose accept loop the wrapper may run itself: vLLM's
# XgrammarGrammar with the fields that loop keeps (checked once per class).
_XGRAMMAR_FAST: dict[type, bool] = {}


def _xgrammar_fast(cls: type) -> bool:
    ok = _XGRAMMAR_FAST.get(cls)
    if ok is None:
        try:
            names = {f.name for f in dataclasses.fields(cls)}
        except TypeError:
            names = set()
        ok = (cls.__name__ == "XgrammarGrammar"
              and cls.__module__.startswith("vllm.")
              and {"matcher", "num_processed_tokens", "_is_terminated"} <= names)
        _XGRAMMAR_FAST[cls] = ok
    return ok


def advance_cut(manager: Any, request: Any, grammar: Any, tokens: list[int]
                ) -> tuple[int, str | None, int | None, int, int]:
    """Advance `grammar` over the committable part of `tokens` (one walk).

    Returns (cut, reason, rejected_token, grammar_start, advanced): the
    grammar has accepted tokens[grammar_start:grammar_start + advanced]
    (cut == grammar_start + advanced whenever advanced > 0); reason as in
    `grammar_cut`.
    """
    n = len(tokens)
    if grammar is None or not n:
        return n, None, None, n, 0
    # Stock's first check in _get_constraint_bounds (after
    # enable_in_reasoning, which gives the same answer): once reasoning has
    # ended the grammar constrains every token. Saves the call per step.
    gs = 0 if request.structured_output_request.reasoning_ended else \
        manager._get_constraint_bounds(request, tokens)[0]
    if gs >= n:
        return n, None, None, n, 0  # every token is reasoning (or ends it)
    tail = tokens[gs:] if gs else tokens
    if _XGRAMMAR_FAST.get(type(grammar)) or _xgrammar_fast(type(grammar)):
        # Stock XgrammarGrammar.accept_tokens, but stopping at (instead of
        # logging) a rejected token: the matcher does not advance on it.
        if grammar._is_terminated:  # noqa: SLF001
            return gs, TERMINATED, None, gs, 0
        matcher = grammar.matcher
        accept = matcher.accept_token
        terminated = matcher.is_terminated
        m = 0
        for token in tail:
            if not accept(token):
                grammar.num_processed_tokens += m
                return gs + m, REJECTED, token, gs, m
            m += 1
            if terminated():
                grammar.num_processed_tokens += m
                grammar._is_terminated = True  # noqa: SLF001 - as stock
                return gs + m, TERMINATED, None, gs, m
        grammar.num_processed_tokens += m
        return n, None, None, gs, m
    if grammar.is_terminated():
        return gs, TERMINATED, None, gs, 0
    # guidance / outlines / other: validate (non-advancing), then accept
    # only the valid prefix (a failed consume is sticky in llguidance).
    valid = grammar.validate_tokens(tail)
    m = len(valid)
    if m and not grammar.accept_tokens(request.request_id, valid):
        # validate_tokens said valid; cannot happen. Nothing is committed.
        logger.error("vllm_patch G2: request %s: grammar accepted %d tokens "
                     "in validate_tokens but not in accept_tokens",
                     request.request_id, m)
        return gs, REJECTED, tail[0], gs, 0
    if grammar.is_terminated():
        return gs + m, TERMINATED, None, gs, m
    if m < len(tail):
        if _stopped_awaiting_eos(grammar, tail[m]):
            grammar.accept_tokens(request.request_id, [tail[m]])
            return gs + m + 1, TERMINATED, None, gs, m + 1
        return gs + m, REJECTED, tail[m], gs, m
    return n, None, None, gs, m


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


_MANAGER_CLS: list[Any] = []


def _is_vllm_manager(manager: Any) -> bool:
    """Is `manager` vLLM's StructuredOutputManager (or a subclass)? The
    cut calls its `_get_constraint_bounds` and the grammars it compiled;
    another object (a test double) cannot answer them."""
    if not _MANAGER_CLS:
        from vllm.v1.structured_output import StructuredOutputManager
        _MANAGER_CLS.append(StructuredOutputManager)
    return isinstance(manager, _MANAGER_CLS[0])


def _wrap_update(original: Callable, v032: bool) -> Callable:
    """Fallback: wrap a stock body this module has not audited (a call
    layer per request, the stock method runs unchanged inside)."""
    def _update_request_with_output(self, request, new_token_ids,
                                    is_stale=False):
        so_req = request.structured_output_request
        if so_req is None:  # unstructured
            if not v032:
                return original(self, request, new_token_ids, is_stale)
            returned = len(new_token_ids)
            kept, stopped = original(self, request, new_token_ids,
                                     is_stale)
            if stopped and len(kept) < returned and \
                    not (is_stale or self.__dict__.get(STALE_ATTR, False)):
                # As 0.33 does: num_computed_tokens covers all kept
                # tokens but the last; trimmed placeholders resolve.
                trimmed = returned - len(kept)
                request.num_computed_tokens -= trimmed
                if request.num_output_placeholders > 0:
                    request.num_output_placeholders -= trimmed
            return kept, stopped
        manager = self.structured_output_manager
        grammar = so_req.grammar
        n = len(new_token_ids)
        # Looked up on the instance, as stock's update_from_output calls it
        # (an instance may provide its own accept_tokens).
        if getattr(manager.accept_tokens, NAME_ATTR, None) == ACCEPT_PATCH:
            cut, reason, rejected, gs, advanced = advance_cut(
                manager, request, grammar, new_token_ids)
        elif not _is_vllm_manager(manager):
            # Not vLLM's StructuredOutputManager (a test double): the cut
            # needs its audited methods; all tokens kept, stock's accept
            # decides, as without this patch.
            cut, reason, rejected, gs, advanced = n, None, None, n, 0
        else:  # validate-only fallback: stock accepts afterwards
            cut, reason, rejected = grammar_cut(manager, request,
                                                new_token_ids)
            gs, advanced = cut, 0
        if reason == TERMINATED and \
                not envs.settings().stop_on_grammar_termination:
            # Stock termination: undo the advance, stock accepts all.
            if advanced:
                grammar.rollback(advanced)
                advanced = 0
            cut, reason = n, None
        if cut < n:
            if not (is_stale or self.__dict__.get(STALE_ATTR, False)):
                dropped = n - cut
                request.num_computed_tokens -= dropped
                if request.num_output_placeholders > 0:
                    request.num_output_placeholders -= dropped
            del new_token_ids[cut:]
        kept, stopped = original(self, request, new_token_ids, is_stale)
        if v032 and stopped and len(kept) < cut and \
                not (is_stale or self.__dict__.get(STALE_ATTR, False)):
            # 0.32, as 0.33 does: a stop trim rolls back
            # num_computed_tokens; placeholders of trimmed tokens resolve.
            trimmed = cut - len(kept)
            request.num_computed_tokens -= trimmed
            if request.num_output_placeholders > 0:
                request.num_output_placeholders -= trimmed
        if advanced:
            kept_len = len(kept)
            if kept_len < cut:
                # Stock stopped earlier (max_tokens, stop token, ...):
                # the grammar keeps only the kept grammar tokens.
                keep = max(kept_len - gs, 0)
                grammar.rollback(advanced - keep)
                advanced = keep
            if advanced:
                if len(ACCEPTED) > 4096:  # never consumed: cannot happen
                    ACCEPTED.clear()
                ACCEPTED[id(kept)] = kept
        if reason is not None and not stopped:
            _finish(self, request, kept, reason, rejected)
            stopped = True
        return kept, stopped

    return _update_request_with_output


# The stock bodies the inline replacements below copy, pinned to the audited
# source (digests in vllm_patch.audited: the one record the registry checks
# and `_audited` reads). Any other source (a patch release that edits them,
# no source available) gets the wrapping fallback instead: same guarantee,
# one call layer more per request; the registry reports the drift.
_SCHED = "vllm.v1.core.sched.scheduler:Scheduler."
_TARGET = _SCHED + "_update_request_with_output"
_SPEC_STATS_TARGET = _SCHED + "make_spec_decoding_stats"
_UPDATE_PIN = pin(
    _TARGET,
    "the inline replacement carries this body verbatim (0.32: plus 0.33's "
    "stop-trim rollback); on any other source the wrapper runs instead",
    fallback=True)
_SPEC_STATS_PIN = pin(
    _SPEC_STATS_TARGET,
    "the inline replacement carries this body verbatim with the cap; on any "
    "other source the wrapper runs instead",
    fallback=True)
# Tests / benchmarks can set this to False to exercise the wrapping fallback.
INLINE_AUDITED = True


def _audited(fn: Callable, pin_: Pin, series: str) -> bool:
    """Is `fn` exactly the stock source `pin_` audited for `series` (the
    body an inline replacement copies)?"""
    digest = pin_.digests.get(series)
    return digest is not None and source_digest(fn) == digest


def _impl(fn: Callable, kind: str) -> Callable:
    """Tag the replacement with the implementation it is ("inline" or
    "wrapper"), for status."""
    setattr(fn, IMPL_ATTR, kind)
    return fn


# The last StructuredOutputManager.accept_tokens seen to be g2-accept-once
# (saves a getattr per request; re-checked whenever the method changes).
_ACCEPT_SEEN: list[Any] = [None]


def _inline_update(original: Callable, v032: bool) -> Callable:
    """Replacement that carries the audited stock body inline.

    Why not a wrapper: one Python call layer per request is about 1 % of
    the stock per-request update, the whole budget for unstructured batches.
    So an unstructured request runs the stock body verbatim, with
    no extra frame (0.32: plus 0.33's stop-trim rollback, inside the stop
    branch only); a structured request runs the G2 cut (the xgrammar accept
    loop inline), the stock body on the kept tokens and the finish, in this
    one frame. Semantics are those of `_wrap_update`, which stays the
    fallback. `check_stop` is the stock module's, bound when applied."""
    check_stop = original.__globals__["check_stop"]
    fallback = _wrap_update(original, v032)

    def _update_request_with_output(self, request, new_token_ids,
                                    is_stale=False):
        so_req = request.structured_output_request
        if so_req is None:
            if v032:
                # Stock 0.32 body; in the stop branch, 0.33's rollback.
                stopped = False
                for num_new, output_token_id in enumerate(new_token_ids, 1):
                    request.append_output_token_ids(output_token_id)
                    stopped = check_stop(request, self.max_model_len)
                    if stopped:
                        trimmed = len(new_token_ids) - num_new
                        if trimmed and not (
                                is_stale
                                or self.__dict__.get(STALE_ATTR, False)):
                            request.num_computed_tokens -= trimmed
                            if request.num_output_placeholders > 0:
                                request.num_output_placeholders -= trimmed
                        del new_token_ids[num_new:]
                        break
                return new_token_ids, stopped
            # Stock 0.33 body, verbatim.
            num_new_tokens = len(new_token_ids)
            stopped = False
            for num_new, output_token_id in enumerate(new_token_ids, 1):
                request.append_output_token_ids(output_token_id)
                stopped = check_stop(request, self.max_model_len)
                if stopped:
                    if not is_stale:
                        request.num_computed_tokens -= \
                            len(new_token_ids) - num_new
                    del new_token_ids[num_new:]
                    break
            if not is_stale and request.num_output_placeholders > 0:
                request.num_output_placeholders -= num_new_tokens
                assert request.num_output_placeholders >= 0
            return new_token_ids, stopped

        # ------------------------------------------------- structured
        manager = self.structured_output_manager
        # Looked up on the instance, as stock's update_from_output calls it
        # (an instance may provide its own accept_tokens).
        accept_fn = manager.accept_tokens
        accept_fn = getattr(accept_fn, "__func__", accept_fn)
        if accept_fn is not _ACCEPT_SEEN[0]:
            if getattr(accept_fn, NAME_ATTR, None) != ACCEPT_PATCH:
                # Validate-only path (stock accepts afterwards).
                return fallback(self, request, new_token_ids, is_stale)
            _ACCEPT_SEEN[0] = accept_fn
        grammar = so_req.grammar
        n = len(new_token_ids)
        rejected = None
        if grammar is not None and so_req.reasoning_ended and \
                (_XGRAMMAR_FAST.get(type(grammar))
                 or _xgrammar_fast(type(grammar))) and \
                not grammar._is_terminated:  # noqa: SLF001
            # advance_cut's xgrammar loop (stock's accept loop, stopping at
            # the terminal / before a rejected token), without its frame.
            accept = grammar.matcher.accept_token
            terminated = grammar.matcher.is_terminated
            reason = None
            m = 0
            for token in new_token_ids:
                if not accept(token):
                    reason, rejected = REJECTED, token
                    break
                m += 1
                if terminated():
                    reason = TERMINATED
                    grammar._is_terminated = True  # noqa: SLF001 - as stock
                    break
            grammar.num_processed_tokens += m
            gs, advanced = 0, m
            cut = m if reason is not None else n
        else:
            cut, reason, rejected, gs, advanced = advance_cut(
                manager, request, grammar, new_token_ids)
        if reason == TERMINATED and \
                not envs.settings().stop_on_grammar_termination:
            # Stock termination: undo the advance, stock accepts all.
            if advanced:
                grammar.rollback(advanced)
                advanced = 0
            cut, reason = n, None
        if cut < n:
            if not (is_stale or self.__dict__.get(STALE_ATTR, False)):
                dropped = n - cut
                request.num_computed_tokens -= dropped
                if request.num_output_placeholders > 0:
                    request.num_output_placeholders -= dropped
            del new_token_ids[cut:]
        # The stock body on the kept tokens (0.32: plus the stop-trim
        # rollback, as 0.33 does).
        num_new_tokens = len(new_token_ids)
        stopped = False
        for num_new, output_token_id in enumerate(new_token_ids, 1):
            request.append_output_token_ids(output_token_id)
            stopped = check_stop(request, self.max_model_len)
            if stopped:
                trimmed = num_new_tokens - num_new
                if v032:
                    if trimmed and not (
                            is_stale or self.__dict__.get(STALE_ATTR, False)):
                        request.num_computed_tokens -= trimmed
                        if request.num_output_placeholders > 0:
                            request.num_output_placeholders -= trimmed
                elif not is_stale:
                    request.num_computed_tokens -= trimmed
                del new_token_ids[num_new:]
                break
        if not v032 and not is_stale and request.num_output_placeholders > 0:
            request.num_output_placeholders -= num_new_tokens
            assert request.num_output_placeholders >= 0
        kept = new_token_ids
        if advanced:
            kept_len = len(kept)
            if kept_len < cut:
                # Stock stopped earlier (max_tokens, stop token, ...): the
                # grammar keeps only the kept grammar tokens.
                keep = max(kept_len - gs, 0)
                grammar.rollback(advanced - keep)
                advanced = keep
            if advanced:
                if len(ACCEPTED) > 4096:  # never consumed: cannot happen
                    ACCEPTED.clear()
                ACCEPTED[id(kept)] = kept
        if reason is not None and not stopped:
            _finish(self, request, kept, reason, rejected)
            stopped = True
        return kept, stopped

    return _update_request_with_output


def _make_update(series: str) -> Callable[[Callable], Callable]:
    v032 = series == "0.32"

    def make(original: Callable) -> Callable:
        if INLINE_AUDITED and _audited(original, _UPDATE_PIN, series):
            return _impl(_inline_update(original, v032), "inline")
        return _impl(_wrap_update(original, v032), "wrapper")

    return make


def _inline_spec_stats(original: Callable) -> Callable:
    """The audited stock body with the cap inline (no call layer per
    request with drafts: about 1 % of an unstructured request's update)."""
    spec_stats_cls = original.__globals__["SpecDecodingStats"]

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens,
                                 num_accepted_tokens, num_invalid_spec_tokens,
                                 request_id):
        if not self.log_stats or not num_draft_tokens:
            return None
        if spec_decoding_stats is None:
            spec_decoding_stats = spec_stats_cls.new(self.num_spec_tokens)
        if num_invalid_spec_tokens:
            invalid = num_invalid_spec_tokens.get(request_id)
            if invalid is not None:
                num_draft_tokens -= invalid
                # G2: never more accepted than real (valid) drafts.
                if num_accepted_tokens > num_draft_tokens:
                    num_accepted_tokens = max(num_draft_tokens, 0)
        spec_decoding_stats.observe_draft(
            num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=num_accepted_tokens)
        return spec_decoding_stats

    return make_spec_decoding_stats


def _make_spec_stats_patch(original: Callable) -> Callable:
    series = version_series(vllm_version())
    if INLINE_AUDITED and _audited(original, _SPEC_STATS_PIN, series):
        return _impl(_inline_spec_stats(original), "inline")
    return _impl(_make_spec_stats(original), "wrapper")


def _make_spec_stats(original):
    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens,
                                 num_accepted_tokens, num_invalid_spec_tokens,
                                 request_id):
        # Without invalidated drafts accepted <= drafts holds (the runner
        # returns at most drafts + 1 tokens): nothing to cap.
        if num_invalid_spec_tokens and request_id in num_invalid_spec_tokens:
            real = num_draft_tokens - num_invalid_spec_tokens[request_id]
            if num_accepted_tokens > real:
                num_accepted_tokens = max(real, 0)
        return original(self, spec_decoding_stats, num_draft_tokens,
                        num_accepted_tokens, num_invalid_spec_tokens, request_id)

    return make_spec_decoding_stats


_UPDATE_SIG = ("self", "request", "new_token_ids", "is_stale")
_SO = "vllm.v1.structured_output."
# What the cut mirrors in vLLM's grammar code (both series).
_CUT_PINS = (
    _UPDATE_PIN,
    pin(_SO + "backend_xgrammar:XgrammarGrammar.accept_tokens",
        "advance_cut and the inline body copy its accept loop (matcher"
        ".accept_token per token, num_processed_tokens, _is_terminated from "
        "matcher.is_terminated), stopping before a rejected token instead of "
        "logging it"),
    pin("vllm.v1.structured_output:StructuredOutputManager._get_constraint_bounds",
        "advance_cut splits off the reasoning part with its uncommitted form "
        "(as validate_tokens does) and skips the call once reasoning_ended, "
        "its first check"),
    pin(_SO + "backend_guidance:GuidanceGrammar.accept_tokens",
        "a stopped llguidance matcher accepts EOS as the terminal "
        "(_stopped_awaiting_eos mirrors it); a failed consume is sticky, so "
        "only a validated prefix is accepted"),
    pin(_SO + "backend_guidance:GuidanceGrammar.validate_tokens",
        "non-advancing; returns [] for everything, EOS included, once the "
        "matcher is stopped (_stopped_awaiting_eos)"),
)
_HOW = ("wrap _update_request_with_output: advance the grammar over the step's "
        "tokens (after the reasoning split) up to the terminal / before the "
        "first rejected token, before the stock append loop (stock's later "
        "accept of those tokens becomes a no-op: g2-accept-once), "
        "delete the tokens after the terminal / from the first rejected token "
        "in place, roll back num_computed_tokens and num_output_placeholders "
        "by the dropped count, then finish the request in the same pass "
        "(FINISHED_STOPPED / FINISHED_ERROR)")
_IMPL_HOW = ("; the replacement is an inline copy of the stock body when "
             "vLLM's source is the audited one (pinned), else a wrapper "
             "around it (one call layer more, same guarantee)")
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
        how=_HOW + _IMPL_HOW,
        upstream=UPSTREAM,
        remove_when=("vLLM treats grammar termination as a stop condition "
                     "and trims at the accepted-length decision"),
        pins=_CUT_PINS,
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
                   "placeholders) for any stop trim, as 0.33 does" + _IMPL_HOW,
        upstream=UPSTREAM + "; vLLM 0.33 stop-trim rollback "
                            "(scheduler.py:2758-2763)",
        remove_when="0.32 support is dropped",
        pins=_CUT_PINS + (
            pin("vllm.v1.core.sched.async_scheduler:"
                "AsyncScheduler._update_request_with_output",
                "0.32's override calls super() without is_stale (published by "
                "g2-async-stale-passthrough-0.32), then subtracts the kept "
                "tokens from num_output_placeholders and caches blocks up to "
                "num_computed_tokens - placeholders: the 0.32 rollback of "
                "trimmed tokens' placeholders keeps that cache point right",
                series=("0.32",)),
        ),
    ),
    Patch(
        name="g2-spec-stats-cap",
        guarantee="G2",
        target=_SPEC_STATS_TARGET,
        versions=("0.32", "0.33"),
        signature=("self", "spec_decoding_stats", "num_draft_tokens",
                   "num_accepted_tokens", "num_invalid_spec_tokens",
                   "request_id"),
        make=_make_spec_stats_patch,
        why=("stock subtracts grammar-invalidated drafts from the proposed "
             "count but not from the accepted count: '2 drafts, 3 accepted'"),
        how=("cap accepted at num_draft_tokens - num_invalid_spec_tokens; "
             "an inline copy of the stock body with the cap when vLLM's "
             "source is the audited one (pinned), else a wrapper"),
        upstream=UPSTREAM,
        remove_when="vLLM caps accepted drafts at the grammar-valid drafts",
        pins=(_SPEC_STATS_PIN,),
    ),
]
