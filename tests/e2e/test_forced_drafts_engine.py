"""Forced drafts with ngram end to end: a real vLLM 0.32 engine on the CPU
(in-process, sync scheduling), the tiny local model, ngram speculative
decoding (k = 4, prompt lookup 1-3 tokens), xgrammar without whitespace,
greedy, three real JSONSchemaBench schemas (../shared/data/jsonschemabench-
dev), the schema in the prompt (as a user would send it).

Patched: the worker's counters show forced drafts and no lost shadow;
the structured requests make more tokens per target step than the same
engine with the feature switched off (VLLM_PATCH_FORCED_DRAFTS=0: stock
ngram drafting), and the greedy outputs of both are token-identical to
non-speculative constrained decoding.
Stock (VLLM_PATCH_DISABLE=1): no forced drafts; ngram proposes text of the
prompt or of earlier outputs, which the grammar cuts at its first
forbidden token.

Tokens per target step: `vllm_patch.testing.engine.tokens_per_step`.

    python -m pytest tests/e2e/test_forced_drafts_engine.py -m e2e -q -s
    VLLM_PATCH_DISABLE=1 python -m pytest tests/e2e/test_forced_drafts_engine.py -m e2e -q -s
"""

from __future__ import annotations

import json

import pytest

from vllm_patch.testing import engine

pytestmark = pytest.mark.e2e

K = 4
MAX_TOKENS = 64
NUM_SCHEMAS = 3


def _generate(schemas, spec: bool):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams as SO

    kwargs = {"structured_outputs_config": {
        "backend": "xgrammar", "disable_any_whitespace": True}}
    if spec:
        kwargs["speculative_config"] = {
            "method": "ngram", "num_speculative_tokens": K,
            "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = engine.start_llm(**kwargs)
    try:
        before = engine.spec_decode_counts(llm)
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                 structured_outputs=SO(json=s)) for s in schemas]
        prompts = ["Schema: " + json.dumps(s)[:400] + "\nJSON: " for s in schemas]
        outs = llm.generate(prompts, params, use_tqdm=False)
        counts = engine.counts_delta(engine.spec_decode_counts(llm), before)
        stats = []
        if spec:
            from vllm_patch.v1.spec_decode.grammar_drafts import grammar_draft_stats

            stats = llm.collective_rpc(grammar_draft_stats)
    finally:
        engine.stop_llm(llm)
    return outs, counts, stats


@pytest.mark.timeout(600)
def test_ngram_forced_drafts_engine(inproc, patched, monkeypatch):
    schemas = engine.benchmark_schemas("xgrammar", NUM_SCHEMAS)
    if not schemas:
        pytest.skip("../shared/data/jsonschemabench-dev is missing")
    assert len(schemas) == NUM_SCHEMAS
    outs, counts, stats = _generate(schemas, spec=True)
    per_step = engine.tokens_per_step(outs, counts)
    print(f"\nFORCED-DRAFTS ngram {'patched' if patched else 'stock'} "
          f"xgrammar k={K}: {per_step:.2f} tokens per step, spec {counts}, "
          f"worker {stats}")
    (s,) = stats
    if not patched:
        # Stock: no forced drafts, ngram's own drafts cut by the grammar.
        assert s["active"] == 0 and not s.get("forced_drafts"), s
        return
    assert s["active"] == 1 and s["shadows"] == NUM_SCHEMAS, s
    assert s["forced_drafts"] > 0 and s["shadows_lost"] == 0, s
    # The same engine with the feature switched off (stock ngram drafting)
    # and without speculative decoding (the greedy reference).
    monkeypatch.setenv("VLLM_PATCH_FORCED_DRAFTS", "0")
    off, off_counts, off_stats = _generate(schemas, spec=True)
    off_per_step = engine.tokens_per_step(off, off_counts)
    print(f"FORCED-DRAFTS ngram feature off: {off_per_step:.2f} tokens per "
          f"step, spec {off_counts}, worker {off_stats}")
    assert not off_stats[0].get("forced_drafts"), off_stats
    assert per_step > off_per_step, (per_step, off_per_step)
    monkeypatch.delenv("VLLM_PATCH_FORCED_DRAFTS")
    reference, _, _ = _generate(schemas, spec=False)
    for got, want, plain in zip(outs, reference, off):
        assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)
        assert list(plain.outputs[0].token_ids) == list(want.outputs[0].token_ids)
