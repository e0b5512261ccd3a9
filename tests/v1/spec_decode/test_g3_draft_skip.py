"""G3 worker side: no draft proposals for requests whose grammar ends
(`g3-no-drafts-after-grammar-end`, `g3-no-drafts-handed-over-after-grammar-end`).

1. The fact the worker relies on, on xgrammar, guidance and outlines: a
   grammar terminates only when it accepts a stop token, never on content.
2. The worker's prediction (stop token sampled from a grammar-filled row,
   read from the real bitmask rows of a real scheduler step) agrees with
   what the real scheduler does with those tokens: patched, the request
   finishes in that pass exactly when predicted (ignore_eos true and false);
   stock keeps an ignore_eos request running (its drafts would be used, so
   the skip is only sound with G2).
3. The patched `GPUModelRunner.propose_draft_token_ids` on a stand-in runner
   with a real bitmask: the drafter does not run when every request ends
   (zero drafts, stock's "does not fit in the drafter" path), runs when one
   goes on (unstructured, no stop token), and under async scheduling the
   in-flight follow-up step is skipped without reading tokens. Stock runs the
   drafter every time.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_patch.conformance import g3 as g3c
from vllm_patch.v1.spec_decode import grammar_end

pytestmark = pytest.mark.scheduler

BACKENDS = ["xgrammar", "guidance", "outlines"]


# ------------------------------------------------------------------ 1. fact
@pytest.mark.parametrize("backend", BACKENDS)
def test_grammar_terminates_only_on_a_stop_token(backend):
    from vllm_patch.testing.harness import EOS, IM_END, Harness

    h = Harness(backend, num_spec_tokens=3)
    cases = {"regex": ("ab", "ab"), "choice": (["yes", "no"], "yes"),
             "json": ({"type": "object", "properties": {"a": {"type": "integer"}},
                       "required": ["a"], "additionalProperties": False},
                      '{"a":1}')}
    for ignore_eos in (True, False):
        for kind, (spec, text) in cases.items():
            rid = h.add_request(ignore_eos=ignore_eos, **{kind: spec})
            g = h.grammar(rid)
            tokens = h.encode(text)
            for t in tokens:  # the whole valid content: never terminated
                assert not g.is_terminated()
                assert g.accept_tokens(rid, [t]), (backend, kind, t)
            assert not g.is_terminated(), (backend, kind, "complete content")
            assert g.accept_tokens(rid, [EOS])
            assert g.is_terminated(), (backend, kind, "after EOS")
            if backend == "xgrammar":
                # Its stop set is the request's all_stop_token_ids: the
                # generation-config EOS terminates it as well.
                g.rollback(1)
                assert not g.is_terminated()
                assert g.accept_tokens(rid, [IM_END]) and g.is_terminated()


# --------------------------------------------- 2. prediction vs the scheduler
def _case(rows, sampled, stops):
    return grammar_end.ends_at(rows, sampled, stops, stop_only=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ignore_eos", [True, False], ids=["ignore_eos", "eos"])
def test_prediction_matches_the_scheduler(backend, ignore_eos, patched, native):
    """Sync scheduler, k=3. Per request one decode step with drafts; the
    sampled tokens end at EOS in the middle (T), at the last token (L), or
    not at all (N: content only, U: unstructured). The prediction from the
    step's real bitmask rows must equal "finished in this pass"."""
    from vllm_patch.testing.harness import EOS, Harness

    h = Harness(backend, num_spec_tokens=3)
    a, b, x = h.tok("a"), h.tok("b"), h.tok("x")
    t = h.add_request(regex="ab", ignore_eos=ignore_eos)
    last = h.add_request(regex="ab", ignore_eos=ignore_eos)
    n = h.add_request(regex="a[ab]*", ignore_eos=ignore_eos)
    u = h.add_request(ignore_eos=ignore_eos)
    h.step({t: [a], last: [a], n: [a], u: [x]},
           drafts={t: [b, EOS, b], last: [b], n: [b, a, b], u: [x, x]})
    sampled = {t: [b, EOS, EOS], last: [b, EOS], n: [b, a, b, a], u: [x, x, x]}
    record = h.step(sampled, clip=True)
    predicted = {}
    for rid in (t, last, n):
        rows = record.bitmask_rows[rid].view(np.uint32)
        stops = grammar_end.stop_set(h.request(rid).sampling_params)
        assert grammar_end.may_end(rows, stops, stop_only=False)
        predicted[rid] = _case(rows, record.sampled[rid], stops)
    assert predicted == {t: 1, last: 1, n: None}
    finished = {rid: h.emitted(rid).finish_reason for rid in (t, last, n, u)}
    assert finished[n] is None and finished[u] is None
    if patched or not ignore_eos or "G2" in native:
        # Every predicted end is a finish in this very pass (G2 / check_stop),
        # and nothing after the terminal was emitted.
        assert finished[t] == finished[last] == "stop"
        assert h.emitted(t).token_ids[-1] == EOS
    else:
        # Stock + ignore_eos: the request keeps running past its grammar's
        # end, so its next drafts would be used (P1): skipping needs G2.
        assert finished[t] is None and finished[last] is None


def test_rows_by_layout():
    """0.33 gives each request k+1 rows, 0.32 packs 1+len(drafts) rows."""
    bm = np.arange(8 * 2, dtype=np.int32).reshape(8, 2)
    spec = {"a": [1, 2], "b": [], "c": [3, 4, 5]}
    rows = grammar_end.request_rows(["a", "b", "c"], bm, spec, 3)
    assert [r[:, 0].tolist() for r in rows.values()] == [[0, 2, 4], [6],
                                                         [8, 10, 12, 14]]
    bm2 = np.arange(12 * 2, dtype=np.int32).reshape(12, 2)
    rows = grammar_end.request_rows(["a", "b", "c"], bm2, spec, 3)
    assert [r[:, 0].tolist() for r in rows.values()] == [[0, 2, 4], [8], [16, 18, 20, 22]]


def test_rows_of_a_real_grammar_output():
    """request_rows() on the scheduler's real GrammarOutput (0.32 packed,
    0.33 strided) gives each request the rows the harness recorded."""
    from vllm_patch.testing.harness import EOS, Harness

    h = Harness("xgrammar", num_spec_tokens=3)
    a, b = h.tok("a"), h.tok("b")
    t = h.add_request(regex="ab", ignore_eos=True)
    n = h.add_request(regex="a[ab]*")
    h.step({t: [a], n: [a]}, drafts={t: [b, EOS], n: [b, b, b]})
    so = h.schedule()
    h.grammar_bitmask(so)
    go = h.scheduler.get_grammar_bitmask(so)
    rows = grammar_end.request_rows(go.structured_output_request_ids,
                                    go.grammar_bitmask,
                                    so.scheduled_spec_decode_tokens, 3)
    record = so._vllm_patch_record
    assert len(rows[t]) == 3 and len(rows[n]) == 4
    for rid in (t, n):
        assert np.array_equal(rows[rid], record.bitmask_rows[rid].view(np.uint32))


def test_reasoning_rows_are_not_grammar_rows():
    """A reasoning row (0.33: all-ones minus reasoning-end ids) must not count
    as a grammar row when a reasoning parser is configured."""
    row = np.full(4, 0xFFFFFFFF, dtype=np.uint32)
    assert not grammar_end.grammar_row(row, {1}, stop_only=False)
    row[0] &= ~np.uint32(1 << 5)  # masked reasoning end
    assert grammar_end.grammar_row(row, {1}, stop_only=False)
    assert not grammar_end.grammar_row(row, {1}, stop_only=True)
    assert grammar_end.ends_at(np.stack([row]), [1], frozenset({1}), True) is None
    stop_only = np.zeros(4, dtype=np.uint32)
    stop_only[0] = (1 << 1) | (1 << 3)
    assert grammar_end.ends_at(np.stack([stop_only]), [1], frozenset({1, 3}), True) == 0
    assert grammar_end.stop_set(SimpleNamespace(min_tokens=2, all_stop_token_ids={1})) \
        == frozenset()


# ------------------------------------------------ 3. the patched proposer call
# Stand-in runner and proposer call: vllm_patch.conformance.g3 (also the
# `vllm-patch verify` scenarios g3-no-drafts-after-grammar-end-*).
_Runner = g3c.ProposerStandIn
_propose = g3c.propose_once


def _grammar_output(h, so_ids, record):
    return g3c.grammar_output_of(record, so_ids)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_drafter_skipped_only_when_every_request_ends(patched, native, async_):
    from vllm_patch.testing.harness import EOS, Harness
    from vllm_patch.v1.worker.gpu_model_runner import g3_drafts as g3

    h = Harness("xgrammar", num_spec_tokens=3)
    a, b, x = h.tok("a"), h.tok("b"), h.tok("x")
    t = h.add_request(regex="ab", ignore_eos=True)
    n = h.add_request(regex="a[ab]*", ignore_eos=True)
    u = h.add_request(ignore_eos=True)
    h.step({t: [a], n: [a], u: [x]}, drafts={t: [b, EOS], n: [b, b], u: [x]})
    so = h.schedule()
    h.grammar_bitmask(so)
    record = so._vllm_patch_record
    spec = {r: list(v) for r, v in so.scheduled_spec_decode_tokens.items()}
    go = _grammar_output(h, [t, n], record)
    params = {r: h.request(r).sampling_params for r in (t, n, u)}

    # T ends (EOS at draft 1), N goes on, U unstructured: drafter runs.
    runner = _Runner([t, n, u], params, async_)
    got = _propose(runner, go, spec, [[b, EOS], [b, b, a], [x, x]])
    assert got == "drafter"
    stats = g3.draft_skip_stats(runner)
    assert stats["token_reads"] == 0  # never read with a request going on

    # Only structured requests, every one ends: skipped (patched).
    runner = _Runner([t, n], params, async_)
    got = _propose(runner, go, spec, [[b, EOS], [b, b, EOS]])
    if not patched or "G3" in native:
        # Stock runs the drafter; a build carrying G3 skips it with its own
        # code (the stand-in calls the runner's method), without the
        # plugin's counters (the plugin does not apply its G3 code there).
        assert got == ("skipped" if "G3" in native else "drafter")
        return
    assert got == "skipped"
    assert g3.draft_skip_stats(runner)["skipped_calls"] == 1
    assert g3.draft_skip_stats(runner)["skipped_request_drafts"] == 2

    # Same, but N samples content only: drafter runs; T's drafts are not
    # handed over (no compute saved there).
    runner = _Runner([t, n], params, async_)
    got = _propose(runner, go, spec, [[b, EOS], [b, b, a]])
    assert got == "drafter"
    assert g3.draft_skip_stats(runner)["dropped_request_drafts"] == 1
    assert runner.__dict__[g3._DROP_ATTR] == {t}
    take = g3._make_take_draft_token_ids(
        lambda self: SimpleNamespace(req_ids=[t, n], draft_token_ids=[[1, 2, 3]] * 2))
    assert take(runner).draft_token_ids == [[], [1, 2, 3]]

    # The next step: T's follow-up step was already in flight (async) and
    # the scheduler, which finished T meanwhile, left it out of the grammar
    # output: skipped without reading tokens.
    runner = _Runner([t], params, async_)
    reads = g3.draft_skip_stats(runner)["token_reads"]
    assert _propose(runner, None, {t: [x, x, x]}, [[x, x, x, x]]) == "skipped"
    assert g3.draft_skip_stats(runner)["token_reads"] == reads

    # A misprediction is noticed (counted; drafting resumes): T, seen ending,
    # is still in the grammar output later than one in-flight step allows.
    runner = _Runner([t, n], params, async_)
    assert _propose(runner, go, spec, [[b, EOS], [b, b, a]]) == "drafter"
    for _ in range(2 if async_ else 1):
        got = _propose(runner, go, spec, [[b, b], [b, b, a]])
    assert got == "drafter"
    assert g3.draft_skip_stats(runner)["mispredicted"] == 1


def test_no_skip_without_g2_termination(patched, native, monkeypatch):
    """VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION=0: the grammar's end is not a
    stop, so the request's drafts are used: the drafter always runs."""
    if "G2" in native:
        pytest.skip("a vLLM build carrying G2 always stops at the grammar's "
                    "end: the switch has no effect there")
    from vllm_patch.testing.harness import EOS, Harness

    monkeypatch.setenv("VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION", "0")
    h = Harness("xgrammar", num_spec_tokens=3)
    a, b = h.tok("a"), h.tok("b")
    t = h.add_request(regex="ab", ignore_eos=True)
    h.step({t: [a]}, drafts={t: [b, EOS]})
    so = h.schedule()
    h.grammar_bitmask(so)
    go = _grammar_output(h, [t], so._vllm_patch_record)
    runner = _Runner([t], {t: h.request(t).sampling_params})
    spec = {r: list(v) for r, v in so.scheduled_spec_decode_tokens.items()}
    assert _propose(runner, go, spec, [[b, EOS]]) == "drafter"


def test_skip_only_for_drafters_whose_path_is_mirrored():
    """The skip reproduces stock's "does not fit in the drafter" path of
    propose_draft_token_ids' EAGLE / draft-model branch only; every other
    drafter keeps stock drafting (extract_hidden_states caches hidden states
    for KV transfer, ngram on the GPU updates its token table instead, ngram
    / suffix / custom proposers have no model forward to save)."""
    import vllm.v1.worker.gpu_model_runner as stock_runner

    from vllm_patch.v1.worker.gpu_model_runner import g3_drafts as g3

    def runner(method: str, drafter_cls, **flags):
        r = _Runner(["r"], {"r": None})
        spec = dict(use_eagle=False, uses_draft_model=False, use_dflash=False)
        spec.update(flags)
        r.speculative_config = SimpleNamespace(
            method=method, **{k: (lambda v=v: v) for k, v in spec.items()})
        r.drafter = object.__new__(drafter_cls)
        return r

    covered = {name: getattr(stock_runner, name) for name in g3.COVERED_DRAFTERS}
    assert all(isinstance(c, type) for c in covered.values()), covered
    assert g3._eligible(runner("eagle", covered["EagleProposer"], use_eagle=True))
    assert g3._eligible(runner("mtp", covered["Gemma4Proposer"], use_eagle=True))
    assert g3._eligible(runner("dflash", covered["DFlashProposer"],
                               use_eagle=True, use_dflash=True))
    assert g3._eligible(runner("draft_model", covered["DraftModelProposer"],
                               uses_draft_model=True))

    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer
    from vllm.v1.spec_decode.ngram_proposer_gpu import NgramProposerGPU
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    assert not g3._eligible(runner("extract_hidden_states",
                                   ExtractHiddenStatesProposer))
    assert not g3._eligible(runner("ngram_gpu", NgramProposerGPU))
    assert not g3._eligible(runner("suffix", SuffixDecodingProposer))
    # A custom proposer subclassing EAGLE's takes stock's custom_class path.
    custom = type("Custom", (covered["EagleProposer"],), {})
    assert not g3._eligible(runner("custom_class", custom))
    # Pipeline parallel: only the last rank samples; stock there.
    pp = runner("eagle", covered["EagleProposer"], use_eagle=True)
    pp.parallel_config.pipeline_parallel_size = 2
    assert not g3._eligible(pp)
