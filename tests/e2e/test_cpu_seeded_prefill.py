"""vLLM's CPU build: a seeded request whose prompt is prefilled in more than
one step must not kill the engine, and its samples must not depend on the
chunking. Stock `_bookkeeping_sync` rewinds the discarded sample's generator
with `set_offset(get_offset() - 4)`, which a CPU generator does not have
("CPU Generator does not use offset"); found by the production-mix soak."""

from __future__ import annotations

import pytest

from vllm_patch.testing.engine import start_llm, stop_llm

pytestmark = pytest.mark.e2e

PROMPTS = [{"prompt_token_ids": [5 + (i * k) % 40 for i in range(200)]} for k in (1, 3)]


def _generate(**engine_args):
    from vllm import SamplingParams

    llm = start_llm(max_num_seqs=4, **engine_args)
    try:
        params = [SamplingParams(max_tokens=6, temperature=0.8, seed=s) for s in (1, 7)]
        return [list(o.outputs[0].token_ids) for o in
                llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        stop_llm(llm)


def test_seeded_prompt_prefilled_in_chunks(inproc, patched):
    chunked = dict(max_num_batched_tokens=64, enable_chunked_prefill=True)
    if not patched:
        with pytest.raises(Exception, match="does not use offset"):
            _generate(**chunked)
        return
    assert _generate(**chunked) == _generate()  # the same seeded samples
