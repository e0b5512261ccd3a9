"""G2 end to end: a real vLLM 0.32 engine on the CPU (in-process engine
core), the tiny local model with itself as `draft_model` (greedy: drafts are
accepted ~100 %, so multi-token steps cross the grammar's end), k = 3 and 5,
xgrammar and guidance, JSON schema / choice / regex requests with and
without ignore_eos, logprobs on.

Patched: every structured output is complete and valid (json.loads +
jsonschema; full match for regex/choice), its last token is the grammar's
terminal and nothing follows it, finish_reason "stop", one logprob row per
token, spec-decode accepted <= drafted; unstructured outputs are identical
to stock (a second, unpatched engine in the same process). Stock
(VLLM_PATCH_DISABLE=1): every ignore_eos request shows the failure G2
removes (tokens after the grammar's end); the requests without ignore_eos
are right on stock too (control). On a patched vLLM build that carries G2
(the patch series), the stock run holds G2 like the patched one: vLLM's own
code stops at the grammar's end (the series tier runs this file there with
the plugin off).

Each run prints one `G2-E2E` line per configuration with the counts.

    python -m pytest tests/e2e/test_g2_engine.py -m e2e -q -s
    VLLM_PATCH_DISABLE=1 python -m pytest tests/e2e/test_g2_engine.py -m e2e -q -s
"""

from __future__ import annotations

import collections

import pytest

from vllm_patch.testing.workload import CHOICES, REGEX, valid
from vllm_patch.testing import engine, tiny_model

pytestmark = pytest.mark.e2e

MAX_TOKENS = 80


def _structured_requests():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams as SO

    kinds = {"json": SO(json=engine.JSON_SCHEMA), "choice": SO(choice=CHOICES),
             "regex": SO(regex=REGEX)}
    out = []
    for ignore_eos in (True, False):
        for kind, so in kinds.items():
            for prompt in engine.PROMPTS:
                out.append(((kind, ignore_eos), prompt, SamplingParams(
                    temperature=0, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos,
                    logprobs=1, structured_outputs=so)))
    return out


def _unstructured_requests():
    from vllm import SamplingParams

    return [(("plain", ie), p, SamplingParams(temperature=0, max_tokens=48,
                                              ignore_eos=ie, logprobs=1))
            for ie in (True, False) for p in engine.PROMPTS]


def _generate(llm, reqs):
    before = engine.spec_decode_counts(llm)
    outs = llm.generate([p for _, p, _ in reqs], [sp for _, _, sp in reqs],
                        use_tqdm=False)
    return outs, engine.counts_delta(engine.spec_decode_counts(llm), before)


def _start(backend: str, k: int):
    target = tiny_model.build_target()
    return engine.start_llm(
        speculative_config={"method": "draft_model", "model": str(target),
                            "num_speculative_tokens": k},
        structured_outputs_config={"backend": backend,
                                   "disable_any_whitespace": True})


def _plain_summary(outs):
    return [(tuple(o.outputs[0].token_ids), o.outputs[0].finish_reason,
             o.outputs[0].stop_reason,
             tuple(round(next(iter(row.values())).logprob, 4)
                   for row in (o.outputs[0].logprobs or [])))
            for o in outs]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("k", [3, 5])
@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_g2_engine(backend, k, patched, inproc):
    from vllm_patch import series

    # A build carrying G2 holds it with the plugin off too.
    native = "G2" in series.native_guarantees()
    holds = patched or native
    structured = _structured_requests()
    plain = _unstructured_requests()
    llm = _start(backend, k)
    try:
        outs, spec = _generate(llm, structured)
        plain_outs, plain_spec = _generate(llm, plain)
    finally:
        engine.stop_llm(llm)

    counts = collections.Counter()
    finish = collections.Counter()
    problems = {True: [], False: []}  # by ignore_eos
    for ((kind, ignore_eos), prompt, _), out in zip(structured, outs):
        c = out.outputs[0]
        finish[(ignore_eos, c.finish_reason)] += 1
        bad = engine.tally_completion(counts, valid(kind, c.text), c)
        if bad:
            problems[ignore_eos].append(f"{kind} {prompt!r}: {'; '.join(bad)}")
    mode = "patched" if patched else "stock, G2 native" if native else "stock"
    print(f"\nG2-E2E {mode} {backend} k={k}: "
          f"valid {counts['valid']}/{counts['requests']}, post-grammar tokens "
          f"{counts['post_grammar_tokens']}, finish (ignore_eos, reason) "
          f"{dict(sorted(finish.items(), key=str))}, spec structured "
          f"{spec['accepted']}/{spec['draft_tokens']} accepted/drafted "
          f"(per pos {spec['per_pos']}), unstructured "
          f"{plain_spec['accepted']}/{plain_spec['draft_tokens']}")

    # Without ignore_eos stock already stops at the terminal (control).
    assert problems[False] == []
    assert spec["accepted"] <= spec["draft_tokens"]
    if not holds:
        # Every ignore_eos request runs on past its grammar's end (P1).
        ignoring = sum(ie for (_, ie), _, _ in structured)
        assert len(problems[True]) == ignoring, problems[True]
        assert all("token(s) after the grammar's end" in p
                   for p in problems[True]), problems[True]
        return
    assert problems[True] == []
    # Multi-token steps happened (else the test proves little).
    assert plain_spec["draft_tokens"] > 0 and plain_spec["acceptance"] >= 0.9
    if not patched:
        return  # the build's own code: no unpatched engine to compare with

    # Unstructured requests: identical to an unpatched engine.
    import vllm_patch
    from vllm_patch import patching

    patching.revert_all()
    try:
        stock = _start(backend, k)
        try:
            stock_outs, _ = _generate(stock, plain)
        finally:
            engine.stop_llm(stock)
    finally:
        vllm_patch.register()
    assert _plain_summary(plain_outs) == _plain_summary(stock_outs)
