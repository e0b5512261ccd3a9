"""Patches of vllm.platforms.cpu: a TEST ONLY switch (opt-in by its own
variable, also honoured under VLLM_PATCH_DISABLE=1 so stock and patched runs
share the set-up; see patching.disabled) and a production fix for
NixlConnector on CPU hosts that run several instances.

1. `cpu-force-async-scheduling`: keep async scheduling on the CPU platform.

`CpuPlatform.check_and_update_config` sets
`scheduler_config.async_scheduling = False` unconditionally and without a
log line. The end-to-end tier needs async scheduling (AsyncScheduler + batch
queue of 2, the path G1/G2/G3 are about), so this switch restores whatever
value the config held when the platform hook was called (the user's choice,
or vLLM's resolved default). Opt-in through
`VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING=1`; never set it in production.

2. `cpu-nixl-kv-core-in-bind` (production fix, on by default; not a
G1-G4 guarantee): keep NIXL's KV-transfer core within the instance's own
cores. NixlConnector's CPU worker reserves "the last core of each NUMA node"
for the KV transfer and moves the worker's main thread there
(`os.sched_setaffinity`, vLLM nixl/base_worker.py, the only caller of
`CpuPlatform.discover_numa_topology` in 0.32 and 0.33). The list comes from
/sys and ignores VLLM_CPU_OMP_THREADS_BIND, so every NIXL instance on one
host lands on the same core. vLLM's own binding ("auto") reserves that core
for one instance per host; with explicit bindings (several instances per
host, as `vllm-patch launch` sets them) nothing does, and one instance's
busy worker starves the other's on the shared core: a 64-request P/D batch
took 180 s instead of 24 s, and an async-scheduling decode worker died on
vLLM's 300 s execute-model timeout (EngineDeadError). The fix keeps, of each
node's list, the cores named in VLLM_CPU_OMP_THREADS_BIND; vLLM's answer
when that variable is "auto"/"nobind" or names none of them.
`VLLM_PATCH_NIXL_CPU_CORE_IN_BIND=0` turns it off; `=1` keeps it on even
under VLLM_PATCH_DISABLE=1, so a stock run can share the set-up of a
patched one.
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


def bound_cores() -> set[int] | None:
    """The cores VLLM_CPU_OMP_THREADS_BIND names ("0-3|4-7": every rank's),
    None for vLLM's own binding ("auto", "nobind") or an unreadable value."""
    raw = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip()
    if raw in ("", "auto", "nobind"):
        return None
    cores: set[int] = set()
    try:
        for part in raw.replace("|", ",").split(","):
            lo, _, hi = part.strip().partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        return None
    return cores


def _make_discover_numa_topology(original: Any) -> classmethod:
    func = original.__func__

    def discover_numa_topology(cls):
        nodes = func(cls)
        allowed = bound_cores()
        if allowed is None:
            return nodes
        kept = [[c for c in node if c in allowed] for node in nodes]
        kept = [node for node in kept if node]
        if not kept:  # none of the bound cores is listed: keep vLLM's answer
            return nodes
        if [max(n) for n in kept] != [max(n) for n in nodes]:
            logger.info(
                "vllm_patch: NixlConnector's KV-transfer core(s) %s, within "
                "VLLM_CPU_OMP_THREADS_BIND=%s (vLLM would pin every NIXL "
                "instance of this host to %s)",
                [max(n) for n in kept], os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                [max(n) for n in nodes])
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
        name="cpu-nixl-kv-core-in-bind",
        guarantee="package",
        target="vllm.platforms.cpu:CpuPlatform.discover_numa_topology",
        versions=("0.32", "0.33"),
        signature=("cls",),
        make=_make_discover_numa_topology,
        why=("NixlConnector's CPU worker pins its main thread to the last core "
             "of each NUMA node from /sys, whatever VLLM_CPU_OMP_THREADS_BIND "
             "says, so the NIXL instances of one host share one core, where a "
             "busy worker starves the other (P/D batches 7x slower, decode "
             "workers past vLLM's execute-model timeout)"),
        how=("wraps the classmethod (whose only caller is that NIXL worker): "
             "keeps, of each node's cores, those VLLM_CPU_OMP_THREADS_BIND "
             "names; vLLM's answer under its own binding (auto/nobind)"),
        upstream="none yet (vLLM nixl/base_worker.py 'reserve different cores')",
        remove_when="vLLM picks the transfer core within the instance's bound cores",
        enabled=lambda s: s.nixl_cpu_core_in_bind is not False,
        keep_when_disabled=lambda s: s.nixl_cpu_core_in_bind is True,
    ),
]
