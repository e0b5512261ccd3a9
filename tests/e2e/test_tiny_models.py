"""The tiny local models work as speculative-decoding drafts in a real
engine: draft_model (the target as its own draft) with an xgrammar JSON
schema request, and the briefly trained EAGLE-1 head."""

from __future__ import annotations

import json

import pytest

from vllm_patch.testing import engine, tiny_model

pytestmark = pytest.mark.e2e


def _run(llm, prompts, params):
    before = engine.spec_decode_counts(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, engine.counts_delta(engine.spec_decode_counts(llm), before)


@pytest.mark.timeout(180)
def test_draft_model_structured_output(inproc):
    import jsonschema
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    target = tiny_model.build_target()
    llm = engine.start_llm(speculative_config={
        "method": "draft_model", "model": str(target), "num_speculative_tokens": 3})
    try:
        _, plain = _run(llm, engine.PROMPTS,
                        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
        schema = SamplingParams(
            temperature=0, max_tokens=96,
            structured_outputs=StructuredOutputsParams(json=engine.JSON_SCHEMA))
        outs, structured = _run(llm, engine.PROMPTS, schema)
        print(f"draft_model k=3 plain={plain} structured={structured}")
        for out in outs:
            jsonschema.validate(json.loads(out.outputs[0].text), engine.JSON_SCHEMA)
        # A draft equal to the target is accepted (near) 100 % under greedy.
        assert plain["draft_tokens"] > 0 and plain["acceptance"] >= 0.95, plain
        assert structured["accepted"] <= structured["draft_tokens"]
        if structured["draft_tokens"]:
            assert structured["acceptance"] >= 0.9, structured
    finally:
        engine.stop_llm(llm)


@pytest.mark.timeout(240)
def test_trained_eagle_accepts(inproc):
    from vllm import SamplingParams

    head = tiny_model.build_eagle(trained=True)  # ~40-60 s once, then cached
    llm = engine.start_llm(speculative_config={
        "method": "eagle", "model": str(head), "num_speculative_tokens": 3})
    try:
        _, counts = _run(llm, engine.PROMPTS,
                         SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        print(f"eagle (trained) k=3 {counts}")
        assert counts["draft_tokens"] > 0
        assert counts["accepted"] > 0, counts
    finally:
        engine.stop_llm(llm)
