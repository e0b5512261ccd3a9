"""G3 for vllm.v1.worker.gpu_model_runner: the V1 runner honours
`num_acceptable_drafts`.

`GrammarOutput.num_acceptable_drafts[i]` is the scheduler's contract that
drafts from that index on must not be accepted (`v1/core/sched/output.py`):
they come after the grammar's end or after a grammar-invalid draft. Model
Runner V2 enforces it (`grammar_invalid_drafts`); the V1 runner (the one the
CPU build always uses and the CUDA build's fallback) never reads it. Under
async scheduling the V1 runner verifies its OWN drafts (scattered into
`input_ids` from the previous step's GPU drafts), not the scheduler's
-1-padded copy, so post-terminal drafts can be accepted (audit P3).

Patch: wrap `GPUModelRunner.sample_tokens`. Before the stock method runs the
rejection sampler, every draft of a structured request at a position
>= num_acceptable_drafts is set to -1 in `spec_decode_metadata
.draft_token_ids` (a copy gathered from `input_ids`, used only by the
rejection sampler). The V1 rejection kernels reject -1 drafts (greedy:
-1 never equals the argmax; random: `draft_token_id < 0`; FLy and synthetic
mode: `>= 0` checks), so the token at the first unacceptable position is the
target's sample from that position's bitmask row, which
`vllm_patch.v1.structured_output` makes the valid-prefix or stop-only row.
Requests whose drafts are all acceptable cost nothing; one small index copy
to the device is made only when some draft must be rejected.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from vllm_patch.patching import Patch

logger = logging.getLogger("vllm_patch")


def unacceptable_draft_positions(
    batch_req_ids: Sequence[str],
    num_draft_tokens: Sequence[int],
    grammar_req_ids: Sequence[str],
    num_acceptable_drafts: Sequence[int],
) -> list[int]:
    """Flat indices (into the rejection sampler's draft_token_ids, batch
    order) of the drafts that must not be accepted."""
    acceptable = dict(zip(grammar_req_ids, num_acceptable_drafts))
    positions: list[int] = []
    start = 0
    for req_id, n in zip(batch_req_ids, num_draft_tokens):
        limit = acceptable.get(req_id)
        if limit is not None and limit < n:
            positions.extend(range(start + max(limit, 0), start + n))
        start += n
    return positions


def mask_unacceptable_drafts(
    draft_token_ids: Any,
    batch_req_ids: Sequence[str],
    num_draft_tokens: Sequence[int],
    grammar_req_ids: Sequence[str],
    num_acceptable_drafts: Sequence[int] | None,
) -> int:
    """Set unacceptable drafts to -1 in place; returns how many."""
    if num_acceptable_drafts is None:
        return 0
    positions = unacceptable_draft_positions(
        batch_req_ids, num_draft_tokens, grammar_req_ids, num_acceptable_drafts)
    if positions:
        import torch

        index = torch.tensor(positions, dtype=torch.long)
        if draft_token_ids.device.type != "cpu":
            index = index.pin_memory().to(draft_token_ids.device,
                                          non_blocking=True)
        draft_token_ids.index_fill_(0, index, -1)
    return len(positions)


def _make_sample_tokens(original: Any) -> Any:
    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        state = getattr(self, "execute_model_state", None)
        if grammar_output is not None and state is not None:
            meta = getattr(state, "spec_decode_metadata", None)
            if meta is not None:
                mask_unacceptable_drafts(
                    meta.draft_token_ids,
                    self.input_batch.req_ids,
                    meta.num_draft_tokens,
                    grammar_output.structured_output_request_ids,
                    grammar_output.num_acceptable_drafts,
                )
        return original(self, grammar_output)

    return sample_tokens


PATCHES: list[Patch] = [
    Patch(
        name="g3-v1-runner-acceptable-drafts",
        guarantee="G3",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
        versions=("0.32", "0.33"),
        signature=("self", "grammar_output"),
        make=_make_sample_tokens,
        why=("the V1 runner ignores num_acceptable_drafts and, under async "
             "scheduling, verifies its own post-terminal drafts (the "
             "scheduler's -1 padding never reaches it): accepted > drafted"),
        how=("before the stock sample_tokens, drafts at positions >= "
             "num_acceptable_drafts become -1 in spec_decode_metadata, which "
             "the rejection sampler always rejects (as Model Runner V2's "
             "grammar_invalid_drafts). Runner-side because rows alone cannot "
             "do it: a stop token drafted after the terminal passes a "
             "stop-only row; the rows (g3-terminal-row, "
             "g3-rows-after-padding-*) make the token sampled at the first "
             "unacceptable position grammar-valid"),
        upstream=("vLLM Model Runner V2 grammar_invalid_drafts "
                  "(v1/worker/gpu/structured_outputs.py); SGLang PR #24082"),
        remove_when="the V1 runner reads num_acceptable_drafts (or is removed)",
    ),
]
