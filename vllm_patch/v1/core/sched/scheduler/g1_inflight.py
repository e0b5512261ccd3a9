"""G1 for vllm.v1.core.sched.scheduler: grammar state is current when it is used.

The scheduler keeps a FIFO of its launched, not yet processed steps (pushed
by `_update_after_schedule`, popped by `update_from_output`; EngineCore
processes outputs once, oldest first), each with the structured requests
whose grammar it will advance. So per request it knows the launched steps
not yet applied to its grammar, and wherever stock uses grammar state:

- `schedule`: a structured request joins a step only if every earlier step
  of it is applied before this step's bitmask is built (sync: none in
  flight; async: only the oldest, with sampling deferred as stock does at
  batch queue 2); otherwise it is held back for one call (PP decode stagger
  below the pipeline depth).
- draft validation: drafts of a request with an unapplied step are stashed
  (sync, batch queue) or left at -1 (async) and validated once it is applied.
- outputs that never reach the grammar leave the FIFO (drop-mode preemption,
  resumable stops, finish/abort); a failed KV load under `recompute` with
  later steps in flight discards those steps' outputs.

That is the mechanism's normal work (`WORK`: counted, logged once per kind,
never raised). The safety nets (`SAFETY_NET`) fire only when something
bypassed it: a bitmask, or drafts validated, for a request whose earlier step
is unapplied; corrected and warned about, or raised as `StaleGrammarError`
under `VLLM_PATCH_STRICT_RUNTIME=1`. With no older step in flight every check
is a length test or one set intersection. Drafts of the right step under PP
+ async (Model Runner V2's one draft slot): g1_step_drafts, called from the
wrappers here.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from vllm.logger import init_logger

from vllm_patch import envs
from vllm_patch.patching import Patch
from vllm_patch.v1.core.sched.scheduler import g1_step_drafts

logger = init_logger(__name__)

_STATE_ATTR = "_vllm_patch_g1"
_EMPTY: frozenset = frozenset()
# More unprocessed steps than any pipeline: update_from_output is not tracked
# (patch skipped or reverted); stop tracking rather than gate forever.
_MAX_DEPTH = 64

# Kinds of event, by request (per scheduler: stats(); per process: COUNTS).
# The mechanism's normal work: vLLM's own engine flows need it; never raised.
GATE = "schedule"            # held back: its earlier step would apply too late
DRAFTS_SYNC = "drafts-sync"  # drafts stashed until the request's step applies
DRAFTS_ASYNC = "drafts-async"  # draft slots left at -1 (earlier step unapplied)
KV_RECOMPUTE = "kv-recompute"  # failed KV load: later in-flight outputs dropped
# The safety net: stale grammar state would be used despite the mechanism
# (something bypassed it). Corrected; raised under VLLM_PATCH_STRICT_RUNTIME=1.
BITMASK = "bitmask"          # bitmask requested while an earlier step unapplied
DRAFTS_STALE = "drafts-stale"  # drafts validated while a step was unapplied
KINDS = (GATE, BITMASK, DRAFTS_SYNC, DRAFTS_ASYNC, KV_RECOMPUTE, DRAFTS_STALE)
WORK = frozenset({GATE, DRAFTS_SYNC, DRAFTS_ASYNC, KV_RECOMPUTE})
SAFETY_NET = frozenset({BITMASK, DRAFTS_STALE})
COUNTS: dict[str, int] = dict.fromkeys(KINDS, 0)

# One log line per kind per process (vLLM's *_once helpers key on the
# message and its arguments, so both are fixed per kind).
_WORK_LINE = {
    GATE: "held a structured-output request back from a step whose grammar "
          "bitmask would have been built before the request's previous step "
          "was applied (decode stagger below the pipeline depth); it joins "
          "the next step instead",
    DRAFTS_SYNC: "kept a request's draft tokens aside until its launched step "
                 "is applied to the grammar (sync scheduling with a batch "
                 "queue); they are validated then",
    DRAFTS_ASYNC: "left a request's draft slots invalid (-1) because an "
                  "earlier step of it is not yet applied to the grammar",
    KV_RECOMPUTE: "a KV load failed (recompute policy) while later steps of "
                  "the request were in flight; their outputs are discarded "
                  "and the request recomputes",
}
_NET_LINE = {
    BITMASK: ("a grammar bitmask was requested for a structured-output "
              "request whose previous step is not yet applied to its grammar",
              "the request is preempted and recomputes from its committed "
              "tokens, without a row in this bitmask"),
    DRAFTS_STALE: ("a structured-output request's draft tokens were "
                   "validated against its grammar while one of its steps was "
                   "still in flight (not yet applied)",
                   "those drafts are dropped; the request's next step runs "
                   "without drafts"),
}


class StaleGrammarError(RuntimeError):
    """Stale grammar state would be used despite G1's mechanism (something
    bypassed it); raised instead of corrected under
    VLLM_PATCH_STRICT_RUNTIME=1."""


class _Entry:
    __slots__ = ("so_id", "live", "doomed")

    def __init__(self, so_id: int, live: Any) -> None:
        self.so_id = so_id
        # Structured requests whose grammar this step will advance.
        self.live = live
        # Structured requests sampled in this step whose output is discarded.
        self.doomed: set | None = None


class G1State:
    __slots__ = ("fifo", "stash", "is_async", "counts")

    def __init__(self, scheduler: Any) -> None:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        self.fifo: deque[_Entry] = deque()
        # req_id -> drafts held back until the request's steps are applied.
        self.stash: dict[str, list[int]] = {}
        self.is_async = isinstance(scheduler, AsyncScheduler)
        self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)

    def find(self, so_id: int) -> int:
        for i, e in enumerate(self.fifo):
            if e.so_id == so_id:
                return i
        return -1

    def blocked(self) -> set:
        """Requests that may not join the next step."""
        entries = list(self.fifo)[1:] if self.is_async else self.fifo
        out: set = set()
        for e in entries:
            out |= e.live
        return out

    def older_live(self, index: int) -> set:
        out: set = set()
        for i in range(index):
            out |= self.fifo[i].live
        return out

    def unapplied(self, req_id: str) -> int:
        return sum(1 for e in self.fifo if req_id in e.live)

    def drop(self, req_id: str, doom: bool) -> None:
        """`req_id`'s in-flight outputs will not reach its grammar."""
        self.stash.pop(req_id, None)
        for e in self.fifo:
            if req_id in e.live:
                e.live = set(e.live)
                e.live.discard(req_id)
                if doom:
                    if e.doomed is None:
                        e.doomed = set()
                    e.doomed.add(req_id)


def state(scheduler: Any) -> G1State:
    st = scheduler.__dict__.get(_STATE_ATTR)
    if st is None:
        st = scheduler.__dict__[_STATE_ATTR] = G1State(scheduler)
    return st


def stats(scheduler: Any) -> dict[str, int]:
    """Events for this scheduler, by kind (requests held back, drafts
    stashed, ...: see KINDS, WORK, SAFETY_NET)."""
    return dict(state(scheduler).counts)


def unapplied_steps(scheduler: Any, req_id: str) -> int:
    """Launched steps of `req_id` not yet applied to its grammar."""
    return state(scheduler).unapplied(req_id)


def _count(st: G1State, kind: str, n: int) -> None:
    st.counts[kind] += n
    COUNTS[kind] += n


def _work(st: G1State, kind: str, req_ids: Any) -> None:
    """The mechanism did its normal work for `req_ids`: count and log (once
    per kind per process); never raises."""
    _count(st, kind, len(req_ids))
    logger.info_once(
        "vllm_patch G1: %s. This is how G1 keeps grammar state current; "
        "logged once, counted per scheduler (kind %r)",
        _WORK_LINE[kind], kind, scope="process")


def _safety_net(st: G1State, kind: str, req_ids: Any) -> None:
    """Stale grammar state would be used for `req_ids` despite the mechanism:
    count; raise under VLLM_PATCH_STRICT_RUNTIME=1, else log (once per kind
    per process) and let the caller correct it."""
    _count(st, kind, len(req_ids))
    what, fix = _NET_LINE[kind]
    if envs.settings().strict_runtime:
        raise StaleGrammarError(
            f"vllm_patch G1: {what} (request(s) {sorted(req_ids)[:8]}). "
            "Grammar state would be used before every step launched for the "
            "request was applied to it: vLLM or a custom scheduler / engine "
            "loop bypassed vllm_patch's ordering (held-back requests, "
            "drafts kept until their step is applied). Raised because "
            "VLLM_PATCH_STRICT_RUNTIME=1; without it vllm_patch corrects "
            f"this: {fix}.")
    logger.warning_once(
        "vllm_patch G1: %s; corrected: %s. vLLM or a custom scheduler / "
        "engine loop bypassed G1's ordering; logged once, counted per "
        "scheduler (kind %r); VLLM_PATCH_STRICT_RUNTIME=1 raises instead",
        what, fix, kind, scope="process")


# ------------------------------------------------------------------ tracking
def _make_after_schedule(original):
    def _update_after_schedule(self, scheduler_output):
        original(self, scheduler_output)
        st = self.__dict__.get(_STATE_ATTR) or state(self)
        live = _EMPTY
        if scheduler_output.has_structured_output_requests:
            # The one O(batch) part of G1's per-step work (about 20 us at
            # batch 256; stock's own loop over the batch just set the flag).
            reqs = self.requests
            live = {rid for rid in scheduler_output.num_scheduled_tokens
                    if not (r := reqs[rid]).is_prefill_chunk
                    and r.structured_output_request is not None}
        fifo = st.fifo
        if fifo and live and st.is_async and \
                not scheduler_output.pending_structured_output_tokens and \
                not live.isdisjoint(fifo[0].live):
            # Defer sampling until the oldest step is processed (stock sets
            # this from num_output_placeholders, which preemption zeroes).
            scheduler_output.pending_structured_output_tokens = True
        if len(fifo) >= _MAX_DEPTH:
            fifo.clear()
            logger.warning_once(
                "vllm_patch G1: %d unprocessed steps; update_from_output is "
                "not tracked, tracking reset", _MAX_DEPTH, scope="process")
        fifo.append(_Entry(id(scheduler_output), live))
        g1_step_drafts.on_schedule(self, scheduler_output)

    return _update_after_schedule


def _make_update_from_output(original):
    def update_from_output(self, scheduler_output, model_runner_output):
        st = self.__dict__.get(_STATE_ATTR)
        if st is not None and st.fifo:
            fifo = st.fifo
            if fifo[0].so_id == id(scheduler_output):
                fifo.popleft()
            else:
                i = st.find(id(scheduler_output))
                if i >= 0:
                    del fifo[i]
        return original(self, scheduler_output, model_runner_output)

    return update_from_output


# ---------------------------------------------------------------------- gate
def _would_schedule(self, request) -> bool:
    """Would stock's running loop give `request` tokens in the next step?"""
    try:
        if (request.num_output_placeholders > 0
                and request.num_computed_tokens + 2 - request.num_output_placeholders
                >= request.num_prompt_tokens + request.max_tokens):
            return False
        if self.current_step + 1 < request.next_decode_eligible_step:
            return False
    except AttributeError:
        pass
    return (request.num_tokens_with_spec + request.num_output_placeholders
            > request.num_computed_tokens)


def _apply_stash(self, st: G1State, update_drafts) -> None:
    from vllm.v1.outputs import DraftTokenIds

    ready = [rid for rid in st.stash if not any(rid in e.live for e in st.fifo)]
    if not ready:
        return
    drafts = [st.stash.pop(rid) for rid in ready]
    live = [(r, d) for r, d in zip(ready, drafts)
            if (q := self.requests.get(r)) is not None and not q.is_finished()]
    if live:
        update_drafts(self, DraftTokenIds([r for r, _ in live],
                                          [d for _, d in live]))


def _make_schedule(original):
    def schedule(self, throttle_prefills=False):
        st = self.__dict__.get(_STATE_ATTR)
        if st is None or not st.fifo or (st.is_async and len(st.fifo) == 1
                                          and not st.stash):
            return original(self, throttle_prefills)
        if st.stash:
            _apply_stash(self, st, type(self).update_draft_token_ids)
        blocked = st.blocked()
        if not blocked:
            return original(self, throttle_prefills)
        from vllm.v1.request import RequestStatus

        gated = []
        attempts = []
        drafted = []
        hold = self.current_step + 2  # schedule() skips while current_step < hold
        for rid in blocked:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.spec_token_ids and not st.is_async:
                # Sync: stock clears a request's drafts when it launches a
                # step and the stash keeps new ones out until that step is
                # applied, so these were validated against a grammar that
                # lacks it (something bypassed the stash).
                drafted.append(req)
            if req.status != RequestStatus.RUNNING:
                continue
            if _would_schedule(self, req):
                attempts.append(rid)
            prev = req.next_decode_eligible_step
            if prev < hold:
                gated.append((req, prev))
                req.next_decode_eligible_step = hold
        try:
            if attempts:
                _work(st, GATE, attempts)
            if drafted:
                _safety_net(st, DRAFTS_STALE,
                            [r.request_id for r in drafted])
                for req in drafted:
                    req.spec_token_ids = []
            return original(self, throttle_prefills)
        finally:
            for req, prev in gated:
                if req.next_decode_eligible_step == hold:
                    req.next_decode_eligible_step = prev

    return schedule


# ------------------------------------------------------------------- bitmask
def _make_bitmask(original):
    def get_grammar_bitmask(self, scheduler_output):
        st = self.__dict__.get(_STATE_ATTR)
        if st is None or not scheduler_output.has_structured_output_requests:
            return original(self, scheduler_output)
        i = st.find(id(scheduler_output))
        if i < 0:
            return original(self, scheduler_output)
        entry = st.fifo[i]
        stale = entry.live & st.older_live(i) if i else _EMPTY
        if stale:
            _safety_net(st, BITMASK, stale)
            _drop_requests(self, st, stale)
        if not entry.doomed:
            return original(self, scheduler_output)
        # Leave out rows whose sampled output will be discarded: nothing is
        # built from a grammar state that does not match the step's inputs.
        hidden = []
        for rid in entry.doomed:
            req = self.requests.get(rid)
            if req is not None and not req.is_prefill_chunk:
                req.is_prefill_chunk = True
                hidden.append(req)
        try:
            return original(self, scheduler_output)
        finally:
            for req in hidden:
                req.is_prefill_chunk = False

    return get_grammar_bitmask


def _drop_requests(self, st: G1State, req_ids: Any) -> None:
    """Discard every in-flight output of `req_ids` (drop-mode preemption):
    they recompute from their committed tokens."""
    from vllm.v1.request import RequestStatus

    now = time.monotonic()
    for rid in list(req_ids):
        req = self.requests.get(rid)
        if req is None:
            continue
        if req.status == RequestStatus.RUNNING:
            try:
                self.running.remove(req)
            except ValueError:
                pass
            self._preempt_request(req, now, drop_stale_output=True)
        else:
            req.drop_stale_output = True
            req.num_stale_output_tokens = req.num_in_flight_tokens
        st.drop(rid, doom=True)


# -------------------------------------------------------------------- drafts
def _make_update_drafts(original):
    def update_draft_token_ids(self, draft_token_ids):
        st = self.__dict__.get(_STATE_ATTR)
        if st is None or not st.fifo:
            if st is not None and st.stash:
                for rid in draft_token_ids.req_ids:
                    st.stash.pop(rid, None)
            return original(self, draft_token_ids)
        unapplied: set = set()
        for e in st.fifo:
            unapplied |= e.live
        ids = draft_token_ids.req_ids
        if unapplied.isdisjoint(ids):
            for rid in ids:
                st.stash.pop(rid, None)
            return original(self, draft_token_ids)
        from vllm.v1.outputs import DraftTokenIds

        keep_ids, keep = [], []
        held = []
        for rid, drafts in zip(ids, draft_token_ids.draft_token_ids):
            if rid in unapplied:
                if len(drafts):
                    held.append(rid)
                    st.stash[rid] = list(drafts)
                else:
                    st.stash.pop(rid, None)
            else:
                st.stash.pop(rid, None)
                keep_ids.append(rid)
                keep.append(drafts)
        if held:
            _work(st, DRAFTS_SYNC, held)
        return original(self, DraftTokenIds(keep_ids, keep))

    return update_draft_token_ids


def _make_update_drafts_in_output(original):
    def update_draft_token_ids_in_output(self, draft_token_ids, scheduler_output):
        st = self.__dict__.get(_STATE_ATTR)
        # Drafts of the step each request's grammar has applied, when the
        # worker hands them by step (Model Runner V2, pipeline parallel).
        draft_token_ids = g1_step_drafts.rekey(
            self, draft_token_ids, scheduler_output,
            None if st is None else st.unapplied)
        i = -1 if st is None else st.find(id(scheduler_output))
        if i <= 0:
            return original(self, draft_token_ids, scheduler_output)
        entry = st.fifo[i]
        stale = entry.live & st.older_live(i)
        if entry.doomed:
            stale = stale | entry.doomed
        stale &= set(draft_token_ids.req_ids)
        if not stale:
            return original(self, draft_token_ids, scheduler_output)
        from vllm.v1.outputs import DraftTokenIds

        if entry.live & stale:
            _work(st, DRAFTS_ASYNC, entry.live & stale)
        pairs = [(r, d) for r, d in zip(draft_token_ids.req_ids,
                                        draft_token_ids.draft_token_ids)
                 if r not in stale]
        return original(self, DraftTokenIds([r for r, _ in pairs],
                                            [d for _, d in pairs]),
                        scheduler_output)

    return update_draft_token_ids_in_output


# ------------------------------------------------ outputs that never apply
def _make_preempt(original):
    def _preempt_request(self, request, timestamp, drop_stale_output=False):
        original(self, request, timestamp, drop_stale_output)
        st = self.__dict__.get(_STATE_ATTR)
        if st is not None:
            st.stash.pop(request.request_id, None)
            if request.drop_stale_output and st.fifo:
                st.drop(request.request_id, doom=True)

    return _preempt_request


def _make_stopped(original):
    def _handle_stopped_request(self, request):
        finished = original(self, request)
        st = self.__dict__.get(_STATE_ATTR)
        if st is not None and (st.fifo or st.stash):
            st.drop(request.request_id, doom=request.drop_stale_output)
        return finished

    return _handle_stopped_request


def _make_free(original):
    def _free_request(self, request, delay_free_blocks=False):
        st = self.__dict__.get(_STATE_ATTR)
        if st is not None and (st.fifo or st.stash):
            st.drop(request.request_id, doom=False)
        return original(self, request, delay_free_blocks)

    return _free_request


def _make_invalid_blocks(original):
    def _handle_invalid_blocks(self, invalid_block_ids, num_scheduled_tokens):
        # Running requests with a later step in flight than this one.
        later = {}
        for req in self.running:
            if req.num_in_flight_tokens > num_scheduled_tokens.get(req.request_id, 0):
                later[req.request_id] = req.num_computed_tokens
        affected = original(self, invalid_block_ids, num_scheduled_tokens)
        if not later or not affected or not self.recompute_kv_load_failures:
            return affected
        st = state(self)
        fixed = []
        for rid in affected:
            if rid not in later:
                continue
            req = self.requests.get(rid)
            if req is None:
                continue
            fixed.append(rid)
            # Valid KV ends before the first in-flight step at the latest.
            req.num_computed_tokens = min(
                req.num_computed_tokens, later[rid] - req.num_in_flight_tokens)
            # The later steps ran on the discarded token: drop their output
            # (drained in lockstep, as after a drop-mode preemption).
            req.num_stale_output_tokens = req.num_in_flight_tokens
            req.drop_stale_output = True
            req.num_output_placeholders = 0
            if req.spec_token_ids:
                req.spec_token_ids = []
            st.drop(rid, doom=True)
        if fixed:
            _work(st, KV_RECOMPUTE, fixed)
        return affected

    return _handle_invalid_blocks


# ------------------------------------------------------------------- records
_SCHED = "vllm.v1.core.sched.scheduler:Scheduler."
_UP = ("SGLang PR #24082 (process the previous result before the next grammar "
       "batch); vLLM #45014/#45015/#56250 (PP + async + grammar)")
_WHEN = ("vLLM tracks unapplied steps per request itself and gates bitmask "
         "building / draft validation on them")
_BOTH = ("0.32", "0.33")


def _patch(name: str, attr: str, sig: tuple[str, ...], make, why: str,
           how: str, pins: tuple = ()) -> Patch:
    return Patch(name=name, guarantee="G1", target=_SCHED + attr, versions=_BOTH,
                 signature=("self",) + sig, make=make, why=why, how=how,
                 upstream=_UP, remove_when=_WHEN, pins=pins)


# vLLM source G1 mirrors or relies on (digests: vllm_patch.audited).
from vllm_patch.audited import pin  # noqa: E402

_PIN_SCHEDULE = pin(
    _SCHED + "schedule",
    "_would_schedule copies the running loop's skip conditions (async "
    "max_tokens placeholders, next_decode_eligible_step) and its token "
    "count; schedule() increments current_step before that loop and skips a "
    "running request while current_step < next_decode_eligible_step, the "
    "field the gate overwrites for one call (the patch series' build changes "
    "only the waiting loop)", on_build=True)
_PIN_ASYNC_AFTER = pin(
    "vllm.v1.core.sched.async_scheduler:AsyncScheduler._update_after_schedule",
    "calls super()._update_after_schedule first and only ORs "
    "pending_structured_output_tokens in (never clears the flag G1 sets); "
    "writes next_decode_eligible_step only under the V2 runner (the gate "
    "restores its own value only while unchanged)")
_PIN_STEPS = (
    pin("vllm.v1.engine.core:EngineCore.step",
        "sync: schedule, then get_grammar_bitmask, then update_from_output of "
        "that same output (nothing else in flight when the bitmask is built)"),
    pin("vllm.v1.engine.core:EngineCore.step_with_batch_queue",
        "each SchedulerOutput reaches update_from_output once, oldest first; "
        "a step marked pending_structured_output_tokens gets its bitmask "
        "(and draft validation) only after the oldest batch in the queue is "
        "processed, which is why the async gate admits a request whose only "
        "unapplied step is the oldest"),
)
_PIN_PREEMPT = pin(
    _SCHED + "_preempt_request",
    "drop mode (drop_stale_output=True): the in-flight output is dropped "
    "(num_stale_output_tokens = num_in_flight_tokens, placeholders 0); "
    "G1 reads request.drop_stale_output after it and mirrors that state for "
    "requests it cannot preempt (not running) and after a recompute")


PATCHES: list[Patch] = [
    _patch("g1-track-launched", "_update_after_schedule", ("scheduler_output",),
           _make_after_schedule,
           "stock knows only num_output_placeholders, not which launched "
           "steps of a request are unapplied",
           "push one FIFO entry per step with the structured requests it "
           "advances; async: mark the step pending if one of them is in the "
           "oldest in-flight step; stamp the step number on the scheduler "
           "output for the worker's per-step drafts (g1_step_drafts)",
           pins=(pin(_SCHED + "_update_after_schedule",
                     "sets request.is_prefill_chunk and scheduler_output"
                     ".has_structured_output_requests for every scheduled "
                     "request; the FIFO entry (scheduled, structured, not a "
                     "prefill chunk) is read from them right after"),
                 _PIN_ASYNC_AFTER) + _PIN_STEPS),
    _patch("g1-track-applied", "update_from_output",
           ("scheduler_output", "model_runner_output"),
           _make_update_from_output,
           "the FIFO entry of a processed step must go",
           "pop the step's FIFO entry before the stock update",
           pins=_PIN_STEPS),
    _patch("g1-gate-schedule", "schedule", ("throttle_prefills",),
           _make_schedule,
           "gap 1: with a decode stagger below the pipeline depth a request "
           "joins a step whose deferred bitmask precedes its previous step's "
           "output; gap 2: a request rescheduled while in flight",
           "for one schedule() call, hold back (next_decode_eligible_step) "
           "structured requests with an unapplied step other than the oldest "
           "(async) / any (sync); validate stashed drafts first",
           pins=(_PIN_SCHEDULE, _PIN_ASYNC_AFTER) + _PIN_STEPS),
    _patch("g1-bitmask-check", "get_grammar_bitmask", ("scheduler_output",),
           _make_bitmask,
           "defense in depth: a bitmask from a grammar missing a launched step",
           "requests with an earlier unapplied step are preempted in drop mode "
           "and left out; rows of discarded outputs are left out",
           pins=(pin(_SCHED + "get_grammar_bitmask",
                     "builds rows only for scheduled requests with "
                     "use_structured_output and not is_prefill_chunk: "
                     "setting is_prefill_chunk=True for the call hides a "
                     "request's row"),
                 _PIN_PREEMPT)),
    _patch("g1-drafts-sync", "update_draft_token_ids", ("draft_token_ids",),
           _make_update_drafts,
           "gap 2: post_step validates the newest batch's drafts before that "
           "batch is applied (stale validation, premature reschedule)",
           "stash the drafts of requests with an unapplied step; validate at "
           "the first schedule() after it is applied"),
    _patch("g1-drafts-async", "update_draft_token_ids_in_output",
           ("draft_token_ids", "scheduler_output"),
           _make_update_drafts_in_output,
           "deferred draft validation must not run on a lagging grammar, "
           "nor with the drafts of another step (pipeline parallel + async: "
           "the worker's one draft slot holds the newest step's, vLLM issue "
           "#54437)",
           "leave the placeholders of such requests at -1; when Model Runner "
           "V2 hands drafts by step, give each request the drafts of the "
           "step its grammar has applied (g1_step_drafts)",
           pins=(pin(_SCHED + "update_draft_token_ids_in_output",
                     "a request absent from draft_token_ids keeps its -1 "
                     "placeholders in scheduled_spec_decode_tokens (no "
                     "acceptable drafts in the bitmask)"),)),
    _patch("g1-preempt-drop", "_preempt_request",
           ("request", "timestamp", "drop_stale_output"), _make_preempt,
           "drop-mode in-flight outputs never reach the grammar",
           "remove the request from the FIFO (drop mode) and its stash",
           pins=(_PIN_PREEMPT,)),
    _patch("g1-stopped-drop", "_handle_stopped_request", ("request",),
           _make_stopped,
           "a resumable stop drops the turn's in-flight outputs",
           "remove the request from the FIFO",
           pins=(pin(_SCHED + "_handle_stopped_request",
                     "a resumable stop drops the turn's in-flight outputs "
                     "(drop_stale_output=True), read right after it"),)),
    _patch("g1-free", "_free_request", ("request", "delay_free_blocks"),
           _make_free,
           "finished/aborted requests never apply their in-flight outputs",
           "remove the request from the FIFO and its stash"),
    _patch("g1-kv-recompute", "_handle_invalid_blocks",
           ("invalid_block_ids", "num_scheduled_tokens"), _make_invalid_blocks,
           "gap C: with kv_load_failure_policy=recompute under async "
           "scheduling stock keeps the later in-flight steps (sampled after "
           "the discarded token) and leaves num_output_placeholders too high",
           "mark the later in-flight outputs drop-mode stale, zero the "
           "placeholders, truncate num_computed_tokens before the first "
           "in-flight step, remove the request from the FIFO",
           pins=(pin(_SCHED + "_handle_invalid_blocks",
                     "under the recompute policy returns the affected running "
                     "requests, which stay running with num_computed_tokens "
                     "truncated"),
                 pin(_SCHED + "_update_requests_with_invalid_blocks",
                     "truncates num_computed_tokens at the first invalid "
                     "block of the step's own tokens and leaves later "
                     "in-flight steps, placeholders and drafts as they are "
                     "(what the patch corrects)"),
                 _PIN_PREEMPT)),
]
