"""A vLLM fix for vllm.v1.worker.gpu_model_runner (package, not a
guarantee): `async-output-placeholders-step`, the runner's half of
`async-output-placeholders-fix` (vllm_patch.v1.worker.gpu_input_batch).
 `_sample` is where the runner asks
its input batch to fill in the previous step's placeholders; the batch
needs the runner's count of drafts each request verified in that step
(`prev_num_draft_tokens`, filled by `_update_states` at the previous
step's row index) to know how many placeholders that step added.
"""

from __future__ import annotations

from typing import Any

from vllm_patch.audited import pin
from vllm_patch.patching import Patch

_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner."


def _make_sample(original: Any) -> Any:
    from vllm_patch.v1.worker.gpu_input_batch import PREV_DRAFTS_ATTR

    def _sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        self.input_batch.__dict__[PREV_DRAFTS_ATTR] = (
            self.prev_num_draft_tokens.np
            if getattr(self, "use_async_spec_decode", False) else None)
        return original(self, logits, spec_decode_metadata)

    return _sample


PATCHES: list[Patch] = [
    Patch(
        name="async-output-placeholders-step",
        guarantee="package",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
        versions=("0.32", "0.33"),
        signature=("self", "logits", "spec_decode_metadata"),
        make=_make_sample,
        why=("the input batch's update_async_output_token_ids cannot tell "
             "the previous step's placeholders from older unfilled ones "
             "(see async-output-placeholders-fix)"),
        how=("before the stock _sample, hands the input batch the runner's "
             "prev_num_draft_tokens (drafts each request verified in the "
             "previous step, by that step's row) under async scheduling "
             "with speculative decoding, else None"),
        upstream="none yet (with async-output-placeholders-fix)",
        remove_when="with async-output-placeholders-fix",
        pins=(
            pin(_RUNNER + "_sample",
                "calls input_batch.update_async_output_token_ids before "
                "sampling, after _update_states filled prev_num_draft_tokens"),
        ),
    ),
]
