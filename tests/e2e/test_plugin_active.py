"""The plugin is active where it matters: inside the engine-core process, on
the scheduler that process really built (package infrastructure; test-only
async switch)."""

from __future__ import annotations

import os

import pytest

import vllm_patch
from vllm_patch import patching
from vllm_patch.patching import State
from vllm_patch.testing import engine
from vllm_patch.v1.engine.core import PROBE_METHOD

pytestmark = pytest.mark.e2e

FORCE_ASYNC = "cpu-force-async-scheduling"


def _qualname(klass: type) -> str:
    return f"{klass.__module__}.{klass.__qualname__}"


def _applied_here() -> set[str]:
    return {n for n, o in patching.REGISTRY.outcomes.items() if o.state is State.APPLIED}


def _expected_on(mro: list[str]) -> list[list[str]]:
    """[class, method, patch] this process applied on a class of `mro`."""
    out = []
    for name, o in patching.REGISTRY.outcomes.items():
        # Per-object patches are installed on objects, not on the class.
        if o.state is State.APPLIED and isinstance(o.owner, type) \
                and not o.patch.per_instance:
            if _qualname(o.owner) in mro:
                out.append([_qualname(o.owner), o.attr, name])
    return out


def _greedy(llm, n=16):
    from vllm import SamplingParams

    outs = llm.generate(engine.PROMPTS, SamplingParams(temperature=0, max_tokens=n),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.timeout(180)
def test_patches_live_in_engine_core(engine_mode, patched):
    llm = engine.start_llm()
    try:
        tokens = _greedy(llm)
        assert all(len(t) == 16 for t in tokens)
        workers = engine.worker_probe(llm)
        if not patched:
            assert all(w["disabled"] for w in workers)
            assert all(s == State.DISABLED.value for w in workers
                       for s in w["outcomes"].values())
            if engine_mode == "mp":
                # The probe is itself a patch: stock EngineCore has no such method.
                with pytest.raises(engine.ProbeUnavailable, match=PROBE_METHOD):
                    engine.engine_core_probe(llm)
                return
            report = engine.engine_core_probe(llm)  # direct call, same process
            assert report["via"] == "in-process (direct)"
            assert report["disabled"]
            assert set(report["outcomes"].values()) == {State.DISABLED.value}
            assert report["engine_core_patched"] == []
            assert report["scheduler_patched"] == []
            return

        report = engine.engine_core_probe(llm)
        if engine_mode == "mp":
            assert report["via"] == "utility call"
            assert report["pid"] != os.getpid()
            assert all(w["pid"] not in (os.getpid(), report["pid"]) for w in workers)
        else:
            assert report["pid"] == os.getpid()
        assert report["vllm"] == patching.vllm_version()
        assert not report["disabled"]
        here = _applied_here()
        there = {n for n, s in report["outcomes"].items() if s == State.APPLIED.value}
        assert here and there == here, (here, report["outcomes"])
        for w in workers:
            assert {n for n, s in w["outcomes"].items() if s == State.APPLIED.value} == here
        # Every patch this process put on a class of the live scheduler (or
        # the engine core) is what that process's live class resolves to.
        assert sorted(report["scheduler_patched"]) == sorted(
            _expected_on(report["scheduler_mro"]))
        assert ["vllm.v1.engine.core.EngineCore", PROBE_METHOD,
                "engine-core-probe"] in report["engine_core_patched"]
        assert all(e in report["scheduler_patched"]
                   for e in report["scheduler_live_patched"])
        # ... and every per-object patch armed here for the scheduler's
        # class is installed on the live scheduler object.
        assert report["scheduler_object_patched"] == sorted(
            name for name, o in patching.REGISTRY.outcomes.items()
            if o.state is State.APPLIED and o.patch.per_instance
            and _qualname(o.owner) in report["scheduler_mro"])
        print(f"{engine_mode} engine-core probe:", report)
    finally:
        engine.stop_llm(llm)


@pytest.mark.timeout(240)
def test_force_async_scheduling_in_engine_core(monkeypatch, patched):
    """VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING=1: AsyncScheduler + batch queue
    live in the engine-core process, workers async, same greedy tokens.
    vLLM loads plugins once per process, so this process (which builds the
    config, hence runs the CPU platform hook) re-registers after setenv."""
    # Reference: stock synchronous scheduling, in-process (fast).
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = engine.start_llm()
    try:
        reference = _greedy(llm, 32)
    finally:
        engine.stop_llm(llm)

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING", "1")
    vllm_patch.register()
    try:
        llm = engine.start_llm(async_scheduling=True)
        try:
            tokens = _greedy(llm, 32)
            workers = engine.worker_probe(llm)
            if not patched:
                # Stock + the test-only switch (it obeys only its own
                # variable): async on, and no guarantee patch, not even the
                # engine-core probe.
                assert all(w["use_async_scheduling"] for w in workers)
                assert all(w["disabled"] for w in workers)
                with pytest.raises(engine.ProbeUnavailable):
                    engine.engine_core_probe(llm)
            else:
                report = engine.engine_core_probe(llm)
                assert report["pid"] != os.getpid()
                assert report["outcomes"][FORCE_ASYNC] == State.APPLIED.value
                assert report["scheduler_class"] == (
                    "vllm.v1.core.sched.async_scheduler.AsyncScheduler")
                assert report["async_scheduling"]
                assert report["batch_queue"] and report["batch_queue_size"] == 2
                assert report["step_fn"] == "step_with_batch_queue"
                assert sorted(report["scheduler_patched"]) == sorted(
                    _expected_on(report["scheduler_mro"]))
                print("async engine-core probe:", report)
                assert all(w["use_async_scheduling"] for w in workers)
            assert tokens == reference
        finally:
            engine.stop_llm(llm)
    finally:
        monkeypatch.delenv("VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING")
        patching.revert_patch(FORCE_ASYNC)
        vllm_patch.register()
