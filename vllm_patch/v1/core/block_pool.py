"""Package diagnostics for vllm.v1.core.block_pool: the invariant checker's
observer of the block pool of an instrumented scheduler (double frees are
caught when they happen). Installed per object by
`vllm_patch.v1.core.sched.scheduler.invariants.instrument`."""

from __future__ import annotations

from typing import Any

from vllm_patch.patching import Patch
from vllm_patch.v1.core.sched.scheduler.invariants import DIAGNOSTICS

FREE_OBSERVER = "invariants-observe-free"


def _free_wrapper(_original: Any, scheduler: Any, pool: Any) -> Any:
    def free_blocks(ordered_blocks, *args, **kwargs):
        blocks = list(ordered_blocks)
        from vllm_patch.v1.core.sched.scheduler.invariants import (
            InvariantViolation,
            checker,
        )

        c = checker(scheduler)
        try:
            c.freeing(blocks)
        except InvariantViolation:
            raise
        except Exception:  # noqa: BLE001 - never break serving
            if c.mode == "raise":
                raise
        return type(pool).free_blocks(pool, blocks, *args, **kwargs)

    return free_blocks


PATCHES: list[Patch] = [
    Patch(
        name=FREE_OBSERVER,
        target="vllm.v1.core.block_pool:BlockPool.free_blocks",
        signature=("self", "ordered_blocks"),
        make=_free_wrapper,
        per_instance=True,
        why="double frees are caught when they happen",
        how="per block-pool object of an instrumented scheduler: record the "
            "blocks freed, then call the class method",
        **DIAGNOSTICS,
    ),
]
