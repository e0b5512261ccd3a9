"""TEST ONLY switches for vllm.platforms.cpu (each opt-in by its own variable,
also honoured under VLLM_PATCH_DISABLE=1 so stock and patched runs share the
set-up; see patching.disabled).

1. `cpu-force-async-scheduling`: keep async scheduling on the CPU platform.

`CpuPlatform.check_and_update_config` sets
`scheduler_config.async_scheduling = False` unconditionally and without a
log line. The end-to-end tier needs async scheduling (AsyncScheduler + batch
queue of 2, the path G1/G2/G3 are about), so this switch restores whatever
value the config held when the platform hook was called (the user's choice,
or vLLM's resolved default). Opt-in through
`VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING=1`; never set it in production.

2. `cpu-nixl-kv-core-in-affinity`: keep NIXL's transfer core within the
instance's CPUs. NixlConnector's CPU worker reserves "the last core of each
NUMA node" for the KV transfer and moves the worker's main thread there
(`CpuPlatform.discover_numa_topology` reads /sys and ignores the CPUs the
instance was given), so every NIXL instance on one host lands on the same
core whatever VLLM_CPU_OMP_THREADS_BIND says, and on a small host a busy
instance starves the others that share it. The switch keeps only the CPUs
the calling thread may already run on. Opt-in through
`VLLM_PATCH_TEST_NIXL_CORE_IN_AFFINITY=1`; nothing in G1-G4 depends on it.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.logger import init_logger

from vllm_patch.patching import Patch

logger = init_logger(__name__)


def _make_check_and_update_config(original: Any) -> classmethod:
    func = original.__func__  # the classmethod object from the class __dict__

    def check_and_update_config(cls, vllm_config):
        scheduler_config = vllm_config.scheduler_config
        asked = scheduler_config.async_scheduling
        func(cls, vllm_config)
        if asked and not scheduler_config.async_scheduling:
            scheduler_config.async_scheduling = asked
            logger.warning_once(
                "vllm_patch: TEST ONLY (VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING=1): "
                "async scheduling forced back ON on the CPU platform, which "
                "turns it off; never use this setting in production"
            )

    return classmethod(check_and_update_config)


def _make_discover_numa_topology(original: Any) -> classmethod:
    func = original.__func__

    def discover_numa_topology(cls):
        nodes = func(cls)
        allowed = os.sched_getaffinity(0)
        kept = [[c for c in node if c in allowed] for node in nodes]
        kept = [node for node in kept if node]
        if not kept:  # none of the instance's CPUs is listed: keep vLLM's answer
            return nodes
        if kept != nodes:
            logger.warning(
                "vllm_patch: TEST ONLY (VLLM_PATCH_TEST_NIXL_CORE_IN_AFFINITY=1): "
                "NIXL transfer cores %s instead of %s (this instance's CPUs: %s)",
                kept, nodes, sorted(allowed))
        return kept

    return classmethod(discover_numa_topology)


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
    Patch(
        name="cpu-nixl-kv-core-in-affinity",
        guarantee="test-only",
        target="vllm.platforms.cpu:CpuPlatform.discover_numa_topology",
        versions=("0.32", "0.33"),
        signature=("cls",),
        make=_make_discover_numa_topology,
        why=("NixlConnector's CPU worker pins its main thread to the last core "
             "of each NUMA node from /sys, so every NIXL instance on one host "
             "shares one core, where a busy prefill worker starves the "
             "decode worker"),
        how=("wraps the classmethod: keeps only the cores the calling thread "
             "may run on (its VLLM_CPU_OMP_THREADS_BIND), vLLM's answer when "
             "none is left"),
        upstream="none yet (vLLM nixl/base_worker.py 'reserve different cores')",
        remove_when="vLLM picks the transfer core within the instance's CPUs",
        enabled=lambda s: s.test_nixl_core_in_affinity,
    ),
]
