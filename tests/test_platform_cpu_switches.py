"""The test-only switch `cpu-nixl-kv-core-in-affinity` on the real
`CpuPlatform.discover_numa_topology` (0.32 and 0.33): off, NixlConnector's
transfer core (the max of each node's list) can be a core the calling thread
was not given, as vLLM computes it from /sys; on, it is one of the thread's
own. The switch obeys its own variable in the stock run too."""

from __future__ import annotations

import os
import threading

import pytest

import vllm_patch
from vllm_patch.patching import REGISTRY, State

pytestmark = pytest.mark.unit

NAME = "cpu-nixl-kv-core-in-affinity"


def _in_thread_bound_to(cpu: int):
    """discover_numa_topology() from a thread bound to `cpu` (as a vLLM
    worker's main thread is by VLLM_CPU_OMP_THREADS_BIND)."""
    from vllm.platforms.cpu import CpuPlatform

    out: dict = {}

    def run() -> None:
        os.sched_setaffinity(0, {cpu})
        out["nodes"] = CpuPlatform.discover_numa_topology()

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    return out["nodes"]


@pytest.fixture
def two_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    return cpus


def test_transfer_core_within_the_threads_cpus(monkeypatch, two_cpus):
    first = two_cpus[0]
    stock_nodes = _in_thread_bound_to(first)
    assert REGISTRY.outcomes[NAME].state is not State.APPLIED
    # vLLM's answer: the node's last core, not the one this thread was given
    assert [max(n) for n in stock_nodes] != [first], stock_nodes

    monkeypatch.setenv("VLLM_PATCH_TEST_NIXL_CORE_IN_AFFINITY", "1")
    vllm_patch.register()
    try:
        assert REGISTRY.outcomes[NAME].state is State.APPLIED
        assert [max(n) for n in _in_thread_bound_to(first)] == [first]
        # a thread allowed everything gets vLLM's answer unchanged
        from vllm.platforms.cpu import CpuPlatform

        assert CpuPlatform.discover_numa_topology() == stock_nodes
    finally:
        monkeypatch.delenv("VLLM_PATCH_TEST_NIXL_CORE_IN_AFFINITY")
        vllm_patch.register()
    assert REGISTRY.outcomes[NAME].state is not State.APPLIED
    assert _in_thread_bound_to(first) == stock_nodes
