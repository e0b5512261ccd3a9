"""A vLLM fix for vllm.v1.worker.gpu_model_runner (package, not a
guarantee): `async-output-count-align`, the V1 runner's token count of a
request never stays ahead of the scheduler's.

Under async scheduling with
speculative decoding the runner counts a request's tokens in
`input_batch.num_tokens_no_spec` one per step (the token it sampled) and
relies on `_update_states` to bring the count back to the scheduler's
(prompt + num_output_tokens, which already knows which drafts were
rejected). Stock aligns only when the request's output list is longer than
the scheduler's count; but the list can legitimately be no longer while the
count is ahead: in a step where penalties, bad words or a custom logits
processor make the runner fill in the previous step's placeholders
(`update_async_output_token_ids`), rejected drafts' placeholders are
removed from the list and the count keeps them. When the next step
schedules fewer drafts (as the scheduler does near max_model_len) the
count stays ahead, and `_bookkeeping_sync` asserts ("Sampled token IDs
exceed the max model length"): the engine core dies. After the stock
method, a count above prompt + num_output_tokens is set to it, as stock's
own alignment does when the list is longer.
"""

from __future__ import annotations

from typing import Any

from vllm_patch.audited import pin
from vllm_patch.patching import Patch

_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner."


def _make_update_states(original: Any) -> Any:
    def _update_states(self: Any, scheduler_output: Any) -> Any:
        result = original(self, scheduler_output)
        if getattr(self, "use_async_spec_decode", False):
            align_token_counts(self, scheduler_output.scheduled_cached_reqs)
        return result

    return _update_states


def align_token_counts(runner: Any, req_data: Any) -> int:
    """Set num_tokens_no_spec of each scheduled request to at most prompt +
    the scheduler's output count; returns how many were ahead."""
    pc = getattr(runner, "parallel_config", None)
    if getattr(pc, "pipeline_parallel_size", 1) != 1:
        return 0  # stock aligns on the last rank only; leave PP alone
    batch = runner.input_batch
    index = batch.req_id_to_index
    counts = batch.num_tokens_no_spec
    prompts = batch.num_prompt_tokens
    ahead = 0
    for req_id, num_output in zip(req_data.req_ids, req_data.num_output_tokens):
        i = index.get(req_id)
        if i is None:
            continue
        limit = int(prompts[i]) + num_output
        if counts[i] > limit:
            counts[i] = limit
            ahead += 1
    if ahead:
        stats = runner.__dict__.setdefault(ALIGN_STATS_ATTR, {"aligned": 0})
        stats["aligned"] += ahead
    return ahead


ALIGN_STATS_ATTR = "_vllm_patch_async_count_align"


PATCHES: list[Patch] = [
    Patch(
        name="async-output-count-align",
        guarantee="package",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
        versions=("0.32", "0.33"),
        signature=("self", "scheduler_output"),
        make=_make_update_states,
        why=("under async scheduling with speculative decoding the runner's "
             "token count of a request stays ahead of the scheduler's after "
             "a step that filled in placeholders of rejected drafts; near "
             "max_model_len _bookkeeping_sync then asserts and the engine "
             "core dies"),
        how=("after the stock _update_states, num_tokens_no_spec of each "
             "scheduled request is set to at most prompt + the scheduler's "
             "num_output_tokens (stock's own alignment, also when the output "
             "list is not longer)"),
        upstream=("none yet (vLLM vllm/v1/worker/gpu_model_runner.py "
                  "_update_states, the num_output_tokens alignment)"),
        remove_when="vLLM aligns num_tokens_no_spec with the scheduler's count",
        pins=(
            pin(_RUNNER + "_update_states",
                "aligns num_tokens_no_spec to num_prompt_tokens + "
                "num_output_tokens only when output_token_ids is longer; "
                "never raises it above that"),
        ),
    ),
]
