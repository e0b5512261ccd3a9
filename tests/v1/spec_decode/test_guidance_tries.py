"""A guidance shadow's tries as one llguidance call
(`grammar_drafts._llguidance_accepts`: `LLMatcher.try_consume_tokens`)
against vLLM's own two (validate_tokens, then accept_tokens), on real
JSONSchemaBench (MaskBench) schemas and documents, the 131k Tekken
vocabulary and vLLM's guidance backend: two grammars of the same schema,
one tried each way with the same tokens (the document's next token, a
random one, the stop token, runs of two or three of them), give the same
answers and stay in the same state (what each then accepts of the rest of
the document, whether it stopped, the next bitmask row).
"""

from __future__ import annotations

import json
import random

import pytest

from vllm_patch.testing.jsonschemabench import MASKBENCH, MISSING, maskbench_entries
from vllm_patch.testing.vocabularies import json_grammar, load_tokenizer, make_backend
from vllm_patch.v1.spec_decode import grammar_drafts as gd

pytestmark = [pytest.mark.scheduler, pytest.mark.patched_only]


def _documents(backend, tokenizer, count: int):
    from vllm_patch.v1.spec_decode.forced_drafts import vocab_for

    out = []
    for spec, g, valid in maskbench_entries(backend):
        text = json.dumps(valid[0], separators=(",", ":"), ensure_ascii=False)
        ids = vocab_for(g, tokenizer).encode_after(text)
        if ids and 8 <= len(ids) <= 200 and len(g.validate_tokens(ids)) == len(ids):
            out.append((spec, ids))
        if len(out) == count:
            break
    return out


def test_guidance_tries_match_vllms_validate_then_accept(monkeypatch):
    if not MASKBENCH.is_dir():
        pytest.skip(MISSING)
    if gd._guidance_accepts is None:
        pytest.skip("this llguidance has no try_consume_tokens")
    import torch

    tokenizer = load_tokenizer("tekken")
    backend = make_backend("guidance", tokenizer)
    docs = _documents(backend, tokenizer, 6)
    assert len(docs) == 6
    fast_calls = []
    real = gd._guidance_accepts

    def counted(grammar, tokens):
        got = real(grammar, tokens)
        fast_calls.append(got is not None)
        return got

    eos = backend.ll_tokenizer.eos_token
    size = backend.vocab_size
    words = (size + 31) // 32
    rng = random.Random(7)
    tried = accepted = 0
    for spec, ids in docs:
        fast, slow = json_grammar(backend, spec), json_grammar(backend, spec)
        pos = 0
        while pos < len(ids):
            kind = rng.random()
            if kind < 0.4:
                tokens = [ids[pos]]
            elif kind < 0.6:
                tokens = [rng.randrange(size)]
            elif kind < 0.65:
                tokens = [eos]
            elif kind < 0.85:
                tokens = ids[pos:pos + rng.randint(2, 3)]
            else:  # a run whose last token is likely refused
                tokens = ids[pos:pos + rng.randint(1, 2)] + [rng.randrange(size)]
            monkeypatch.setattr(gd, "_guidance_accepts", counted)
            got = gd._accepts(fast, "r", tokens)
            monkeypatch.setattr(gd, "_guidance_accepts", None)
            want = gd._accepts(slow, "r", tokens)
            assert got == want, (spec[:80], pos, tokens)
            tried += 1
            if got:
                accepted += 1
                pos += len(tokens)
                if eos in tokens:
                    break
            # The same state: the rest of the document, stopped or not, the
            # next row.
            rest = ids[pos:] + [eos]
            assert fast.validate_tokens(rest) == slow.validate_tokens(rest)
            assert fast.ll_matcher.is_stopped() == slow.ll_matcher.is_stopped()
            assert fast.is_terminated() == slow.is_terminated()
            rows = torch.zeros((2, words), dtype=torch.int32)
            fast.fill_bitmask(rows, 0)
            slow.fill_bitmask(rows, 1)
            assert torch.equal(rows[0], rows[1]), (spec[:80], pos)
            # Neither matcher was put in its error state by a refusal.
            assert not fast.ll_matcher.is_error() and not slow.ll_matcher.is_error()
        if pos == len(ids):
            # At the document's end both take the stop token alike.
            assert gd._accepts(fast, "r", [eos]) == gd._accepts(slow, "r", [eos])
    # Real tries of both outcomes, most of them through the one call (the
    # stop token's go through vLLM's calls).
    assert tried > 100 and 0 < accepted < tried, (tried, accepted)
    assert sum(fast_calls) > 0.8 * len(fast_calls), (sum(fast_calls), len(fast_calls))
