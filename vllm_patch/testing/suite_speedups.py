"""pytest plugin for `vllm_suites` runs: skip vLLM's per-test global cleanup.

vLLM's tests/conftest.py tears every test down with
`cleanup_dist_env_and_memory()` (gc, distributed groups, accelerator cache)
unless the test carries vLLM's own `skip_global_cleanup` marker, which vLLM
documents as a ~10x speed-up for non-GPU unit tests. On a CPU-only machine
that teardown costs 2-5 s a test; marking every test makes the scheduler
suites run in minutes. Both modes get it, so the stock/patched comparison is
unaffected. Used with `-p vllm_patch.testing.suite_speedups`.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker("skip_global_cleanup")
