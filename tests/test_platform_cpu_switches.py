"""The NIXL transfer-core fix `cpu-nixl-kv-core-in-bind` on the real
`CpuPlatform.discover_numa_topology` (0.32 and 0.33), whose only caller is
NixlConnector's CPU worker: it pins its main thread to the max of each list.
Patched (on by default), an instance bound to one core by
VLLM_CPU_OMP_THREADS_BIND gets that core; stock (VLLM_PATCH_DISABLE=1), the
host's last core from /sys, whatever the binding says. Its own variable
decides in both runs: 0 turns it off, 1 keeps it on under
VLLM_PATCH_DISABLE=1 (stock NIXL pairs in tests share the set-up)."""

from __future__ import annotations

import os

import pytest

import vllm_patch
from vllm_patch.patching import REGISTRY, State

pytestmark = pytest.mark.unit

NAME = "cpu-nixl-kv-core-in-bind"
VAR = "VLLM_PATCH_NIXL_CPU_CORE_IN_BIND"


def _transfer_cores() -> list[int]:
    from vllm.platforms.cpu import CpuPlatform

    return [max(n) for n in CpuPlatform.discover_numa_topology()]


@pytest.fixture
def first_cpu(monkeypatch):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    monkeypatch.delenv(VAR, raising=False)
    yield cpus[0]
    monkeypatch.delenv(VAR, raising=False)
    vllm_patch.register()


def test_transfer_core_within_the_bound_cores(monkeypatch, first_cpu, patched):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    vllm_patch.register()
    host_default = _transfer_cores()  # vLLM's own binding: its answer, both runs
    assert host_default != [first_cpu], host_default

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", str(first_cpu))
    if patched:
        assert REGISTRY.outcomes[NAME].state is State.APPLIED
        assert _transfer_cores() == [first_cpu]
    else:  # stock: the host's last core, not the one the instance was given
        assert REGISTRY.outcomes[NAME].state is State.DISABLED
        assert _transfer_cores() == host_default

    monkeypatch.setenv(VAR, "0")  # off in both runs
    vllm_patch.register()
    assert REGISTRY.outcomes[NAME].state is not State.APPLIED
    assert _transfer_cores() == host_default

    monkeypatch.setenv(VAR, "1")  # on in both runs, also under VLLM_PATCH_DISABLE=1
    vllm_patch.register()
    assert REGISTRY.outcomes[NAME].state is State.APPLIED
    assert _transfer_cores() == [first_cpu]
