"""G1 for vllm.v1.worker.gpu.spec_decode.utils (Model Runner V2): drafts
handed to the scheduler keyed by the scheduler step that proposed them.

Stock `DraftTokensHandler` keeps one slot: every `sample_tokens` overwrites
it with its batch's drafts, and `take_draft_token_ids` returns whatever is
there. With pipeline parallelism + async scheduling the batch queue holds
pp + 1 steps, so when EngineCore's deferred branch takes drafts to validate
a structured request's next step, the slot holds the drafts of the newest
sampled step, which (decode stagger = pp) never contains that request: its
drafts are never validated, its spec tokens stay -1 and every draft is
rejected, one token per step for grammar requests (vLLM issue #54437).

Here the handler also keeps a small map step -> (req_ids, drafts) for the
last `KEEP` steps whose batch had structured requests (the step is the
scheduler's stamp on the scheduler output, noted by the patched runner's
`execute_model`, see `note_step`), and `get_draft_tokens` returns stock's
`DraftTokenIds` of the newest step as a `StepDraftTokenIds` carrying that
map. The scheduler side (`vllm_patch.v1.core.sched.scheduler.g1_step_drafts`)
gives each request the drafts of the step its grammar has applied. Without
the scheduler stamp (or without the scheduler side) nothing changes: the
map stays empty or is ignored, and the fields are stock's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.v1.outputs import DraftTokenIds

from vllm_patch.audited import pin
from vllm_patch.patching import Patch
# The attribute the scheduler stamps on each SchedulerOutput; the handler
# keeps it for the step being run (note_step). One name for both sides.
from vllm_patch.v1.core.sched.scheduler.g1_step_drafts import STEP_ATTR
_SNAPS_ATTR = "_vllm_patch_step_drafts"  # step -> (req_ids, np drafts)
# Steps kept: the deepest batch queue is pp + 1; 16 covers pp <= 15.
KEEP = 16

__all__ = ["KEEP", "STEP_ATTR", "StepDraftTokenIds", "note_step"]


@dataclass
class StepDraftTokenIds(DraftTokenIds):
    """Stock's `DraftTokenIds` (the newest step's drafts) plus the drafts of
    the last steps by scheduler step: step -> (req_ids, drafts)."""

    by_step: dict[int, tuple[list[str], list[list[int]]]] = field(
        default_factory=dict)


def note_step(handler: Any, scheduler_output: Any, dummy_run: bool = False) -> None:
    """The step whose drafts `handler.set_draft_tokens` records next: the
    scheduler's stamp on the scheduler output being executed (None for a
    dummy run or an unstamped output; then nothing is recorded)."""
    step = None if dummy_run else getattr(scheduler_output, STEP_ATTR, None)
    handler.__dict__[STEP_ATTR] = step


def _make_set_draft_tokens(original: Any) -> Any:
    def set_draft_tokens(self: Any, input_batch: Any, draft_tokens: Any) -> None:
        original(self, input_batch, draft_tokens)
        d = self.__dict__
        step = d.get(STEP_ATTR)
        if step is None or self.draft_tokens_np is None:
            return  # unstamped, or no structured request in the batch
        snaps: dict = d.setdefault(_SNAPS_ATTR, {})
        snaps[step] = (list(self.req_ids), self.draft_tokens_np)
        while len(snaps) > KEEP:
            del snaps[min(snaps)]

    return set_draft_tokens


def _make_get_draft_tokens(original: Any) -> Any:
    def get_draft_tokens(self: Any) -> Any:
        out = original(self)
        snaps: dict = self.__dict__.get(_SNAPS_ATTR) or {}
        if out is None or not snaps:
            return out
        # Every copy was issued on copy_stream before the last recorded
        # event: one wait covers them all (stock waited only if the newest
        # batch had structured requests).
        self.copy_event.synchronize()
        by_step = {step: (list(ids), drafts.tolist())
                   for step, (ids, drafts) in snaps.items()}
        return StepDraftTokenIds(out.req_ids, out.draft_token_ids, by_step)

    return get_draft_tokens


_H = "vllm.v1.worker.gpu.spec_decode.utils:DraftTokensHandler."
_WHY = ("with pipeline parallelism + async scheduling, Model Runner V2 hands "
        "the scheduler drafts through one slot that every step overwrites, so "
        "a structured request's next step is validated with the drafts of "
        "another step (it loses them: -1, every draft rejected)")
_UPSTREAM = "vLLM issue #54437; vLLM PR #56802 (open) keys draft snapshots by step"
_REMOVE = "vLLM keys drafts by scheduler step (PR #56802 or equivalent)"
_WITHOUT = ("with pipeline parallelism + async scheduling on Model Runner V2, "
            "structured requests get no validated drafts (stock: one token "
            "per step for them; output stays grammar-valid)")

PATCHES: list[Patch] = [
    Patch(
        name="g1-v2-step-drafts-record",
        guarantee="G1",
        target=_H + "set_draft_tokens",
        versions=("0.32", "0.33"),
        signature=("self", "input_batch", "draft_tokens"),
        make=_make_set_draft_tokens,
        why=_WHY,
        how=("after the stock method, keeps the batch's req_ids and copied "
             "drafts under the scheduler step being run (last 16 steps with "
             "structured requests)"),
        upstream=_UPSTREAM, remove_when=_REMOVE, required=False,
        without=_WITHOUT,
        pins=(pin(_H + "set_draft_tokens",
                  "req_ids and draft_tokens_np are the batch's (a fresh "
                  "async copy per call); draft_tokens_np is None when the "
                  "batch has no structured request"),),
    ),
    Patch(
        name="g1-v2-step-drafts-hand-over",
        guarantee="G1",
        target=_H + "get_draft_tokens",
        versions=("0.32", "0.33"),
        signature=("self",),
        make=_make_get_draft_tokens,
        why=_WHY,
        how=("returns stock's DraftTokenIds (newest step) as a "
             "StepDraftTokenIds that also carries the recorded steps' drafts "
             "by scheduler step"),
        upstream=_UPSTREAM, remove_when=_REMOVE, required=False,
        without=_WITHOUT,
        pins=(pin(_H + "get_draft_tokens",
                  "copies are awaited with copy_event.synchronize(); returns "
                  "DraftTokenIds(req_ids, drafts)"),
              pin("vllm.v1.engine.core:EngineCore.step_with_batch_queue",
                  "the deferred branch takes drafts after processing the "
                  "oldest step, before the deferred step's bitmask")),
    ),
]
