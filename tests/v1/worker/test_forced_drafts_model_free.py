"""Forced drafts for ngram on the V1 runner: vLLM's own
`GPUModelRunner.propose_draft_token_ids` (its ngram branch, a real
NgramProposer) and `_copy_draft_token_ids_to_cpu` run on a stand-in runner
holding what those methods read (input batch arrays, request states, the
configs), with shadow grammars compiled by a real scheduler's
structured-output manager (xgrammar, guidance) and the tiny model's
tokenizer.

Three requests: a structured one whose prompt (the schema text) gives the
n-gram lookup a match that the grammar forbids, a structured one whose
prompt gives no match at all (empty slots), and an unstructured one.
Patched: the structured drafts start with the grammar's forced
continuation and are grammar-valid as a whole (the committed grammar takes
them all); the empty slots get the forced continuation; the unstructured
request's drafts are stock's; the shadows end where they started and the
committed grammars were not touched; a later step continues from the new
outputs. Stock: the n-gram drafts of the first request are not
grammar-valid and the second gets none.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_patch.v1.spec_decode import grammar_drafts as gd
from vllm_patch.v1.spec_decode.forced_drafts import forced_bytes, forced_tokens

pytestmark = pytest.mark.scheduler

K = 4
SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer"},
                         "description": {"type": "string"}},
          "required": ["id", "description"],
          "additionalProperties": False}
STRUCTURED = 3  # rows 0-2 structured, row 3 not


def _setup(backend):
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    from vllm_patch.testing.harness import Harness

    h = Harness(backend, num_spec_tokens=K, disable_any_whitespace=True)
    # Row 0: the prompt shows the schema: ngram finds `{"` there and
    # proposes what followed it (`type": "`...), which the grammar forbids.
    # Row 1: nothing to match (empty slots). Row 2: an example output, so
    # ngram continues the forced key validly. Row 3: unstructured.
    prompts = [h.encode("Schema: " + json.dumps(SCHEMA) + " Answer: "),
               h.encode("x y z"),
               h.encode('Example: {"id":12,"description":"ok"} Answer: '),
               h.encode("x y z")]
    rids = [h.add_request(p, json=SCHEMA) for p in prompts[:STRUCTURED]]
    rids.append(h.add_request(prompts[STRUCTURED]))
    config = h.vllm_config
    drafter = NgramProposer(config)
    max_len = config.model_config.max_model_len
    token_ids = np.zeros((len(rids), max_len), dtype=np.int32)
    out = {rid: h.encode('{"') for rid in rids[:STRUCTURED]}
    out[rids[STRUCTURED]] = h.encode(" x")
    for i, rid in enumerate(rids):
        row = prompts[i] + out[rid]
        token_ids[i, :len(row)] = row
    requests = {rid: SimpleNamespace(
        sampling_params=h.request(rid).sampling_params,
        output_token_ids=list(out[rid])) for rid in rids}
    runner = SimpleNamespace(
        speculative_config=config.speculative_config, drafter=drafter,
        vllm_config=config, num_spec_tokens=K, requests=requests,
        use_async_scheduling=False, parallel_config=config.parallel_config,
        input_batch=SimpleNamespace(
            req_ids=list(rids), token_ids_cpu=token_ids,
            num_tokens_no_spec=np.array(
                [len(prompts[i]) + len(out[r]) for i, r in enumerate(rids)],
                dtype=np.int32)),
        _draft_token_ids=None, _draft_probs=None, _draft_prob_req_ids=None)
    return h, rids, runner


def _step(runner, sampled):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    so = SimpleNamespace(total_num_scheduled_tokens=len(sampled),
                         num_spec_tokens_to_schedule=K,
                         has_structured_output_requests=True)
    runner._draft_token_ids = GPUModelRunner.propose_draft_token_ids(
        runner, so, sampled, None, None, None, None, None, None, None)
    GPUModelRunner._copy_draft_token_ids_to_cpu(runner, so)
    return runner._draft_token_ids


def _commit(h, runner, rids, tokens):
    """The step's tokens, as bookkeeping and the scheduler commit them."""
    batch = runner.input_batch
    for i, rid in enumerate(rids):
        runner.requests[rid].output_token_ids.extend(tokens[i])
        n = int(batch.num_tokens_no_spec[i])
        batch.token_ids_cpu[i, n:n + len(tokens[i])] = tokens[i]
        batch.num_tokens_no_spec[i] = n + len(tokens[i])
        if i < STRUCTURED:
            assert h.grammar(rid).accept_tokens(rid, tokens[i])


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_ngram_drafts_forced_first(backend, patched):
    h, rids, runner = _setup(backend)
    structured = rids[:STRUCTURED]
    for rid in structured:
        assert h.grammar(rid).accept_tokens(rid, h.encode('{"'))
    committed = [forced_bytes(h.grammar(rid)) for rid in structured]
    sampled = [list(runner.requests[r].output_token_ids) for r in rids]
    stock_ngram = runner.drafter.propose(
        K, sampled, runner.input_batch.num_tokens_no_spec,
        runner.input_batch.token_ids_cpu)
    drafts = _step(runner, sampled)
    tokenizer = h.structured_output_manager.tokenizer
    forced = [forced_tokens(h.grammar(rid),
                            runner.requests[rid].output_token_ids, tokenizer, K)
              for rid in structured]
    print(f"\nFORCED-NGRAM {'patched' if patched else 'stock'} {backend}: "
          f"drafts {drafts}, forced {forced}, stock ngram {stock_ngram}")
    assert all(forced) and all(len(f) < K for f in forced), forced
    valid = [h.grammar(rid).validate_tokens(list(drafts[i]))
             for i, rid in enumerate(structured)]
    assert [forced_bytes(h.grammar(rid)) for rid in structured] == committed
    if not patched:
        assert stock_ngram[0] and len(valid[0]) < len(drafts[0]), drafts
        assert drafts[1] == [], drafts
        return
    for i in range(STRUCTURED):
        assert drafts[i][:len(forced[i])] == forced[i], (drafts, forced)
        assert valid[i] == drafts[i], (drafts, valid)
        assert len(drafts[i]) <= K
    # Row 2: the proposer's own drafts follow the forced ones.
    assert len(drafts[2]) > len(forced[2]), (drafts, forced)
    assert drafts[STRUCTURED] == stock_ngram[STRUCTURED]  # unstructured
    t = runner.drafter.__dict__[gd.TRACKER_ATTR]
    assert t.stats["forced_rows"] == STRUCTURED, t.stats
    assert t.stats["shadows"] == STRUCTURED, t.stats
    for i, rid in enumerate(structured):  # shadows back at the committed state
        assert forced_bytes(t.shadows[rid].grammar) == committed[i]

    # Next step: the drafts are accepted (the target would add a bonus
    # token), the shadows follow, and the forced continuation moves on.
    step = [list(d) for d in drafts[:STRUCTURED]] + [h.encode(" y")[:1]]
    _commit(h, runner, rids, step)
    drafts = _step(runner, step)
    for i, rid in enumerate(structured):
        assert h.grammar(rid).validate_tokens(list(drafts[i])) == drafts[i]
        assert forced_bytes(t.shadows[rid].grammar) == \
            forced_bytes(h.grammar(rid))
    assert t.stats["shadows_lost"] == 0, t.stats


def test_ngram_shadow_catches_up_after_a_skipped_step(patched):
    """A step in which the runner does not call the drafter (its input does
    not fit): the next call advances the shadows by every output they have
    not seen."""
    if not patched:
        pytest.skip("patched mechanism (stock keeps no shadow)")
    h, rids, runner = _setup("xgrammar")
    structured = rids[:STRUCTURED]
    for rid in structured:
        assert h.grammar(rid).accept_tokens(rid, h.encode('{"'))
    sampled = [list(runner.requests[r].output_token_ids) for r in rids]
    _step(runner, sampled)
    skipped = [h.encode('id":1')] * STRUCTURED + [h.encode(" y")]
    _commit(h, runner, rids, skipped)  # no drafter call for this step
    step = [h.encode('2,"')] * STRUCTURED + [h.encode(" z")]
    _commit(h, runner, rids, step)
    drafts = _step(runner, step)
    t = runner.drafter.__dict__[gd.TRACKER_ATTR]
    for i, rid in enumerate(structured):
        assert forced_bytes(t.shadows[rid].grammar) == \
            forced_bytes(h.grammar(rid)) == b'description":"'
        assert drafts[i] and \
            h.grammar(rid).validate_tokens(list(drafts[i])) == drafts[i]
    assert t.stats["shadows"] == STRUCTURED, t.stats
    assert t.stats["shadows_lost"] == 0, t.stats


@pytest.mark.patched_only
def test_status_line_names_the_drafters():
    from vllm_patch import envs

    forced, masked, _ = gd.feature_status(envs.settings())
    assert forced["status"] == "on" and masked["status"] == "on"
    assert "ngram and suffix decoding" in forced["reason"], forced
    assert "ngram" not in masked["reason"], masked


class _SuffixCache:
    """Stand-in for arctic_inference's SuffixDecodingCache (not installable
    here: a source package that builds native code and registers its own
    vLLM plugin): a suffix "tree" that continues the pattern with the text
    that followed its last token in the request's prompt and outputs."""

    def __init__(self):
        self.active_requests: set[str] = set()
        self.cached_requests: set[str] = set()
        self.tokens: dict[str, list[int]] = {}
        self.patterns: list[list[int]] = []

    def start_request(self, req_id, prompt):
        self.active_requests.add(req_id)
        self.tokens[req_id] = [int(x) for x in prompt]

    def add_active_response(self, req_id, ids):
        self.tokens[req_id].extend(int(x) for x in ids)

    def stop_request(self, req_id):
        self.active_requests.discard(req_id)

    def speculate(self, req_id, pattern, max_spec_tokens, max_spec_factor,
                  min_token_prob):
        pattern = [int(x) for x in pattern]
        self.patterns.append(pattern)
        seen = self.tokens[req_id]
        last = pattern[-1]
        for j in range(len(seen) - 2, -1, -1):
            if seen[j] == last:
                return SimpleNamespace(token_ids=seen[j + 1:j + 1 + max_spec_tokens])
        return SimpleNamespace(token_ids=[])


def test_suffix_decoding_forced_first(patched):
    """Suffix decoding (vLLM's SuffixDecodingProposer.propose, a stand-in
    suffix cache): patched, the row with an example in its prompt drafts
    the forced continuation, then the tree's continuation after it; stock
    drafts what the tree continues from `{"`."""
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    h, rids, runner = _setup("xgrammar")
    drafter = SuffixDecodingProposer.__new__(SuffixDecodingProposer)
    drafter.num_speculative_tokens = K
    drafter.max_tree_depth = 24
    drafter.max_spec_factor = 1.0
    drafter.min_token_prob = 0.1
    drafter.max_model_len = h.vllm_config.model_config.max_model_len
    drafter.suffix_cache = _SuffixCache()
    no = lambda: False  # noqa: E731
    spec = SimpleNamespace(method="suffix", use_ngram_gpu=no, use_eagle=no,
                           uses_draft_model=no)
    runner.speculative_config = spec
    runner.drafter = drafter
    batch = runner.input_batch
    batch.req_id_to_index = {r: i for i, r in enumerate(rids)}
    batch.num_prompt_tokens = batch.num_tokens_no_spec - np.array(
        [len(runner.requests[r].output_token_ids) for r in rids])
    for rid in rids[:STRUCTURED]:
        assert h.grammar(rid).accept_tokens(rid, h.encode('{"'))
    sampled = [list(runner.requests[r].output_token_ids) for r in rids]
    drafts = _step(runner, sampled)
    tokenizer = h.structured_output_manager.tokenizer
    forced = [forced_tokens(h.grammar(rid), runner.requests[rid].output_token_ids,
                            tokenizer, K) for rid in rids[:STRUCTURED]]
    valid = [h.grammar(rid).validate_tokens(list(drafts[i]))
             for i, rid in enumerate(rids[:STRUCTURED])]
    print(f"\nFORCED-SUFFIX {'patched' if patched else 'stock'}: drafts {drafts}, "
          f"forced {forced}")
    if not patched:
        assert drafts[0] and len(valid[0]) < len(drafts[0]), drafts
        assert drafts[1] == [], drafts
        return
    for i in range(STRUCTURED):
        assert drafts[i][:len(forced[i])] == forced[i] and valid[i] == drafts[i]
    assert len(drafts[2]) > len(forced[2]), drafts
    # The tree was asked again with the forced tokens appended.
    assert drafter.suffix_cache.patterns[-1][-len(forced[2]):] == forced[2]
