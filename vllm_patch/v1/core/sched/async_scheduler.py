"""G2 for vllm.v1.core.sched.async_scheduler (0.32 only).

0.32's `AsyncScheduler._update_request_with_output` calls
`super()._update_request_with_output(request, new_token_ids)` without
`is_stale`, so the G2 wrapper on `Scheduler` cannot tell a stale delivery
(preempted request, counters already reset) from a live one. This wrapper
publishes `is_stale` on the scheduler for the duration of the call. 0.33 has
no override (the base method handles placeholders itself)."""

from __future__ import annotations

from vllm_patch.audited import pin
from vllm_patch.patching import Patch
from vllm_patch.v1.core.sched.scheduler.g2_commit_cut import STALE_ATTR, UPSTREAM


def _make(original):
    def _update_request_with_output(self, request, new_token_ids, is_stale=False):
        self.__dict__[STALE_ATTR] = is_stale
        try:
            return original(self, request, new_token_ids, is_stale)
        finally:
            self.__dict__[STALE_ATTR] = False

    return _update_request_with_output


PATCHES: list[Patch] = [
    Patch(
        name="g2-async-stale-passthrough-0.32",
        guarantee="G2",
        target=("vllm.v1.core.sched.async_scheduler:"
                "AsyncScheduler._update_request_with_output"),
        versions=("0.32",),
        signature=("self", "request", "new_token_ids", "is_stale"),
        make=_make,
        why=("0.32's override drops is_stale when calling super(); the G2 "
             "rollback must not touch a stale delivery's counters"),
        how="set self._vllm_patch_is_stale around the original call",
        upstream=UPSTREAM,
        remove_when="0.32 support is dropped",
        pins=(pin("vllm.v1.core.sched.async_scheduler:"
                  "AsyncScheduler._update_request_with_output",
                  "calls super()._update_request_with_output(request, "
                  "new_token_ids) without is_stale, inside this call",
                  series=("0.32",)),),
    ),
]
