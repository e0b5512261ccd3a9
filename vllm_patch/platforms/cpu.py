"""TEST ONLY: keep async scheduling on the CPU platform.

`CpuPlatform.check_and_update_config` (vllm/platforms/cpu.py, 0.32: line 331,
0.33: line 348) sets `scheduler_config.async_scheduling = False`
unconditionally and without a log line. The end-to-end tier needs async
scheduling (AsyncScheduler + batch queue of 2, the path G1/G2/G3 are about),
so this switch restores whatever value the config held when the platform hook
was called (the user's choice, or vLLM's resolved default). Opt-in through
`VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING=1`; never set it in production.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_patch.patching import Patch

logger = logging.getLogger("vllm_patch")


def _make_check_and_update_config(original: Any) -> classmethod:
    func = original.__func__  # the classmethod object from the class __dict__

    def check_and_update_config(cls, vllm_config):
        scheduler_config = vllm_config.scheduler_config
        asked = scheduler_config.async_scheduling
        func(cls, vllm_config)
        if asked and not scheduler_config.async_scheduling:
            scheduler_config.async_scheduling = asked
            logger.warning(
                "vllm_patch: TEST ONLY (VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING=1): "
                "async scheduling forced back ON on the CPU platform, which "
                "turns it off; never use this setting in production"
            )

    return classmethod(check_and_update_config)


PATCHES: list[Patch] = [
    Patch(
        name="cpu-force-async-scheduling",
        guarantee="test-only",
        target="vllm.platforms.cpu:CpuPlatform.check_and_update_config",
        versions=("0.32", "0.33"),
        signature=("cls", "vllm_config"),
        make=_make_check_and_update_config,
        why=("the CPU platform silently turns async scheduling off, so the "
             "e2e tier could not exercise AsyncScheduler + batch queue"),
        how=("wraps the classmethod: reads scheduler_config.async_scheduling "
             "before the original and restores it afterwards, with a warning"),
        upstream="none (vLLM: '# async scheduling is not required on CPU')",
        remove_when="never in production; test-only switch",
        enabled=lambda s: s.test_force_async_scheduling,
    ),
]
