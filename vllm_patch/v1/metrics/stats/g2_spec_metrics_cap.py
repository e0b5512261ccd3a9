"""G2 for vllm.v1.metrics.stats: per-request spec-decode metrics never count
more accepted tokens than real drafts (the scheduler-level stats are capped by
`vllm_patch.v1.core.sched.scheduler.g2_commit_cut`)."""

from __future__ import annotations

from vllm_patch.audited import pin
from vllm_patch.patching import Patch
from vllm_patch.v1.core.sched.scheduler.g2_commit_cut import UPSTREAM


def _make_observe(original):
    def observe(self, num_draft_tokens, num_accepted, detailed=False):
        # The scheduler passes drafts already net of grammar-invalidated ones.
        if num_accepted > num_draft_tokens:
            num_accepted = max(num_draft_tokens, 0)
        return original(self, num_draft_tokens, num_accepted, detailed)

    return observe


PATCHES: list[Patch] = [
    Patch(
        name="g2-request-spec-metrics-cap",
        guarantee="G2",
        target="vllm.v1.metrics.stats:RequestSpecDecodeMetrics.observe",
        versions=("0.32", "0.33"),
        signature=("self", "num_draft_tokens", "num_accepted", "detailed"),
        make=_make_observe,
        why=("update_from_output observes (drafts - invalid, accepted): "
             "post-terminal acceptances make accepted > drafts"),
        how="cap num_accepted at num_draft_tokens",
        upstream=UPSTREAM,
        remove_when="vLLM caps accepted drafts at the grammar-valid drafts",
        pins=(pin("vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
                  "observes num_draft_tokens net of the step's "
                  "num_invalid_spec_tokens, so the cap is the real drafts"),),
    ),
]
