"""G1 for vllm.v1.core.sched.scheduler: a structured request's deferred step
is validated with the drafts of the step its grammar has applied.

Under async scheduling EngineCore defers a step with structured requests
still in flight (`step_with_batch_queue`), processes the oldest step, then
takes the worker's drafts and validates them for the deferred step
(`update_draft_token_ids_in_output`). The drafts a request's deferred step
verifies on the worker are the ones proposed after that request's previous
step. Stock takes one slot holding the newest sampled step's drafts: right
at batch queue 2, wrong with pipeline parallelism (queue pp + 1, decode
stagger pp: the newest step never holds the request), vLLM issue #54437.

Here every scheduler output is stamped with a step number (`STEP_ATTR`,
read on the worker by Model Runner V2's patched runner), the scheduler keeps
per structured request the step it was last launched in before the current
one, and when the worker hands drafts by step (`StepDraftTokenIds`, from
`vllm_patch.v1.worker.gpu.spec_decode.utils`) each request of the deferred
step gets the drafts of its previous step, only if that step is the one its
grammar has applied (G1's in-flight queue: no step of it other than this one
is unapplied) and the worker's batch of that step holds the request; else it
is scheduled without drafts (-1, as stock leaves it). Without per-step
drafts (V1 runner, worker side not patched) stock runs unchanged.

The registry allows one patch per target, so these run inside G1's
registered patches of the same methods (g1_inflight: g1-track-launched calls
`on_schedule`, g1-drafts-async calls `rekey`).
"""

from __future__ import annotations

from typing import Any

# Stamped on each SchedulerOutput here; read on the worker by Model Runner
# V2's patched runner (vllm_patch.v1.worker.gpu.spec_decode.utils imports it).
STEP_ATTR = "_vllm_patch_step"
_STATE_ATTR = "_vllm_patch_step_drafts"


class _State:
    __slots__ = ("step", "launched", "rekeyed", "missing")

    def __init__(self) -> None:
        self.step = 0
        # req_id -> (step before the newest launch, newest launch step)
        self.launched: dict[str, tuple[int | None, int]] = {}
        # Requests given drafts of their own previous step / left without.
        self.rekeyed = 0
        self.missing = 0


def _state(scheduler: Any) -> _State:
    st = scheduler.__dict__.get(_STATE_ATTR)
    if st is None:
        st = scheduler.__dict__[_STATE_ATTR] = _State()
    return st


def stats(scheduler: Any) -> dict[str, int]:
    """Requests of deferred steps given the drafts of their own previous
    step ('rekeyed'), or none because that step's drafts were not there or
    its grammar had not applied it ('missing')."""
    st = _state(scheduler)
    return {"rekeyed": st.rekeyed, "missing": st.missing}


def previous_step(scheduler: Any, req_id: str) -> int | None:
    """The step `req_id` was launched in before its newest launch."""
    got = _state(scheduler).launched.get(req_id)
    return None if got is None else got[0]


def on_schedule(scheduler: Any, scheduler_output: Any) -> None:
    """After stock `_update_after_schedule` (called from G1's wrapper):
    stamp the step and note each structured request's launch."""
    st = _state(scheduler)
    st.step += 1
    step = st.step
    setattr(scheduler_output, STEP_ATTR, step)
    launched = st.launched
    for rid in scheduler_output.finished_req_ids or ():
        launched.pop(rid, None)
    # Preempted: the worker drops its state (drafts too); a request that
    # (re)starts has no drafts of an earlier step on the worker.
    for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
        launched.pop(rid, None)
    if scheduler_output.has_structured_output_requests:
        restart = {n.req_id for n in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        restart.update(getattr(cached, "resumed_req_ids", None) or ())
        reqs = scheduler.requests
        for rid in scheduler_output.num_scheduled_tokens:
            req = reqs.get(rid)
            if req is not None and req.structured_output_request is not None:
                got = launched.get(rid)
                launched[rid] = (None if got is None or rid in restart
                                 else got[1], step)


def rekey(scheduler: Any, draft_token_ids: Any, scheduler_output: Any,
          unapplied: Any = None) -> Any:
    """Before stock `update_draft_token_ids_in_output` (called from G1's
    wrapper): the drafts each request of the deferred step verifies on the
    worker, when the worker hands drafts by step; else `draft_token_ids`
    unchanged. `unapplied(req_id)`: launched steps not yet applied to its
    grammar (G1's in-flight queue)."""
    by_step = getattr(draft_token_ids, "by_step", None)
    step = getattr(scheduler_output, STEP_ATTR, None)
    if by_step is None or step is None:
        return draft_token_ids
    from vllm.v1.outputs import DraftTokenIds

    st = _state(scheduler)
    index: dict[int, dict[str, list[int]]] = {}
    ids: list[str] = []
    drafts: list[list[int]] = []
    for rid in scheduler_output.scheduled_spec_decode_tokens:
        got = st.launched.get(rid)
        if got is None or got[1] != step:
            continue  # not a tracked structured request: stock hands it none
        prev = got[0]
        # Its grammar has applied every launched step but this one.
        applied = unapplied is None or unapplied(rid) <= 1
        snap = by_step.get(prev) if prev is not None and applied else None
        if snap is not None and prev not in index:
            index[prev] = dict(zip(snap[0], snap[1]))
        mine = index[prev].get(rid) if snap is not None else None
        if mine is None:
            st.missing += 1
            continue
        st.rekeyed += 1
        ids.append(rid)
        drafts.append(list(mine))
    return DraftTokenIds(ids, drafts)
