"""Grammar-aware drafting on the real drafter class (vLLM's EagleProposer,
whose `_sample_draft_tokens` is where each draft position's logits become
token ids), CPU tensors, a stand-in drafter model whose logits the test
chooses (every structured row prefers a token the grammar forbids), and the
shadow grammars compiled by a real scheduler's structured-output manager
(xgrammar, guidance).

The shadows come from the scheduler's manager (the in-process executor)
or, as in a multiprocess worker, from the worker's own manager (no
scheduler's manager in the worker's process; the backend class chosen from
the request's parameters: xgrammar, guidance, outlines).

Patched: masked rows never propose a token the grammar forbids; a position
where the grammar allows one token gets it (also with masking off: forced
drafts alone); the unstructured row's drafts are bit-identical to stock's
argmax; after drafting the shadows are back at the committed state and the
committed grammar was never touched; drafts after the grammar's end are
not handed over. Stock: the structured rows propose the forbidden tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_patch.v1.spec_decode import grammar_drafts as gd

pytestmark = pytest.mark.scheduler

K = 4
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}},
          "required": ["ok"], "additionalProperties": False}


class _Model:
    """Stand-in drafter model: the hidden states ARE the logits."""

    def compute_logits(self, hidden_states):
        return hidden_states.clone()


def _drafter(vllm_config):
    from vllm.v1.spec_decode.eagle import EagleProposer

    d = EagleProposer.__new__(EagleProposer)
    d.vllm_config = vllm_config
    d.model = _Model()
    d._enable_probabilistic_draft_probs = False
    d.use_local_argmax_reduction = False
    d.use_heterogeneous_vocab = False
    d.parallel_drafting = False
    d.num_speculative_tokens = K
    return d


def _setup(backend):
    from vllm_patch.testing.harness import Harness

    # vLLM takes disable_any_whitespace with xgrammar and guidance only.
    h = Harness(backend, num_spec_tokens=K,
                disable_any_whitespace=backend != "outlines")
    rids = [h.add_request(json=SCHEMA), h.add_request(regex="abc"),
            h.add_request()]
    for rid in rids[:2]:
        h.wait_for_grammar(rid)
    requests = {rid: SimpleNamespace(
        sampling_params=h.request(rid).sampling_params, output_token_ids=[])
        for rid in rids}
    return h, rids, requests


def _draft(h, drafter, rids, requests, bad):
    """k positions; every row's logits prefer `bad` (row 2: its own
    random preference), as the drafter would. Returns drafts, logits."""
    vocab = h.vllm_config.model_config.get_vocab_size()
    gen = torch.Generator().manual_seed(0)
    gd.advance(drafter, requests, rids, [[-1]] * len(rids), [False] * len(rids))
    gd.begin(drafter, len(rids))
    meta = SimpleNamespace(all_greedy=True)
    drafts, logits_seen = [], []
    try:
        for _ in range(K):
            logits = torch.randn(len(rids), vocab, generator=gen)
            logits[:2, bad] = 100.0
            logits_seen.append(logits.clone())
            ids, probs = drafter._sample_draft_tokens(logits, meta)
            assert probs is None
            drafts.append(ids.tolist())
    finally:
        gd.end(drafter)
    return [list(col) for col in zip(*drafts)], logits_seen


def _forced_positions(h, rid, tokens):
    """Per position: the only token the grammar allows there, or None."""
    g = h.grammar(rid)
    words = (h.vllm_config.model_config.get_vocab_size() + 31) // 32
    out, walked = [], 0
    for t in tokens:
        mask = torch.full((1, words), -1, dtype=torch.int32)
        g.fill_bitmask(mask, 0)
        allowed = gd.allowed_mask(mask, h.vllm_config.model_config.get_vocab_size())[0]
        out.append(int(allowed.nonzero()[0, 0]) if int(allowed.sum()) == 1 else None)
        if not g.accept_tokens(rid, [t]):
            break
        walked += 1
    if walked:
        g.rollback(walked)
    return out


BACKEND_CLASSES = {"xgrammar": "XgrammarBackend", "guidance": "GuidanceBackend",
                   "outlines": "OutlinesBackend"}


@pytest.mark.parametrize("backend,where,path", [
    ("xgrammar", "scheduler", "lazy"), ("guidance", "scheduler", "lazy"),
    ("xgrammar", "worker", "lazy"), ("guidance", "worker", "lazy"),
    ("outlines", "worker", "lazy"),
    # The accelerator's path on CPU tensors: top-k candidates up front, the
    # masked argmax of the rows that refused them read one position later.
    ("xgrammar", "scheduler", "upfront"), ("guidance", "scheduler", "upfront")])
def test_masked_drafts(backend, where, path, patched, monkeypatch):
    monkeypatch.delenv("VLLM_PATCH_MASKED_DRAFTS", raising=False)
    monkeypatch.delenv("VLLM_PATCH_FORCED_DRAFTS", raising=False)
    monkeypatch.setattr(gd, "CANDIDATES_UPFRONT", path == "upfront")
    h, rids, requests = _setup(backend)
    if where == "worker":
        # A multiprocess worker: no scheduler's manager in its process.
        monkeypatch.setattr(gd, "find_manager", lambda config: None)
    bad = h.tok("x")
    drafter = _drafter(h.vllm_config)
    drafts, logits = _draft(h, drafter, rids, requests, bad)
    if patched:
        t = drafter.__dict__[gd.TRACKER_ATTR]
        manager = t.manager
        if where == "worker":
            # The worker's own manager, its backend the request's.
            assert manager is not h.structured_output_manager
            assert t.local_manager is manager
            assert manager not in gd.MANAGERS
            assert type(manager.backend).__name__ == BACKEND_CLASSES[backend]
            assert gd.stats(drafter)["worker_local"] == 1
        else:
            assert manager is h.structured_output_manager
            assert t.local_manager is None
    # Unstructured row: stock's argmax, bit for bit.
    assert drafts[2] == [int(l[2].argmax()) for l in logits]
    valid = {rid: h.grammar(rid).validate_tokens(d) == d
             for rid, d in zip(rids[:2], drafts[:2])}
    if not patched:
        assert not any(valid.values()), drafts  # the forbidden token drafted
        assert all(d[0] == bad for d in drafts[:2]), drafts
        return
    assert all(valid.values()), (valid, drafts)
    for rid, d in zip(rids[:2], drafts[:2]):
        for want, got in zip(_forced_positions(h, rid, d), d):
            assert want is None or want == got, (rid, d)
    # The regex "abc" walks to its end; the json object is still open.
    stats = gd.stats(drafter)
    # Forced text comes from the grammar's forced continuation ahead of the
    # model's drafts (here the regex "abc" and the json's '{"ok":'); a
    # position with one allowed token the candidates missed is "forced".
    # (outlines has no forced text: the one-allowed-token rows only.)
    forced = stats["forced"] if backend == "outlines" else stats["forced_ahead"]
    assert stats["positions"] > 0 and forced > 0, stats
    if path == "upfront":
        # At most one device-to-host read per draft position (advance is
        # given host lists here: no read of the sampled tokens).
        assert stats["d2h_syncs"] <= K, stats
    # Shadows are back at the committed state: the same drafts again.
    again, _ = _draft(h, drafter, rids, requests, bad)
    assert again[:2] == drafts[:2]
    # The committed grammars were never advanced.
    for rid, d in zip(rids[:2], drafts[:2]):
        assert h.grammar(rid).validate_tokens(d) == d


def test_forced_drafts_without_masking(patched, monkeypatch):
    monkeypatch.setenv("VLLM_PATCH_MASKED_DRAFTS", "0")
    monkeypatch.setenv("VLLM_PATCH_FORCED_DRAFTS", "1")
    h, rids, requests = _setup("xgrammar")
    bad = h.tok("x")
    drafter = _drafter(h.vllm_config)
    drafts, logits = _draft(h, drafter, rids, requests, bad)
    assert drafts[2] == [int(l[2].argmax()) for l in logits]
    # regex "abc": a, b, c are each the only token allowed (then stop
    # tokens: EOS and the generation-config EOS, two, so not forced).
    a, b, c = h.tok("a"), h.tok("b"), h.tok("c")
    if not patched:
        assert drafts[1][0] == bad
        return
    assert drafts[1][:3] == [a, b, c], drafts
    # json row: its forced positions get their token, the others keep the
    # drafter's choice until it leaves the grammar.
    forced = _forced_positions(h, rids[0], drafts[0])
    for want, got in zip(forced, drafts[0]):
        assert want is None or want == got
    s = gd.stats(drafter)
    assert s["forced_ahead"] >= 3 and s["masked_changed"] == 0, s


@pytest.mark.patched_only
def test_switches_off_is_stock(patched, monkeypatch):
    """Control: both switches off, the patched drafter drafts as stock."""
    monkeypatch.setenv("VLLM_PATCH_MASKED_DRAFTS", "0")
    monkeypatch.setenv("VLLM_PATCH_FORCED_DRAFTS", "0")
    h, rids, requests = _setup("xgrammar")
    bad = h.tok("x")
    drafter = _drafter(h.vllm_config)
    drafts, _ = _draft(h, drafter, rids, requests, bad)
    assert all(d[0] == bad for d in drafts[:2]), drafts
    assert gd.stats(drafter)["active"] == 0


@pytest.mark.patched_only
def test_drafts_after_grammar_end_not_handed_over():
    out = SimpleNamespace(req_ids=["a", "b"], draft_token_ids=[[1, 2, 3], [4, 5, 6]])
    stats = {"drafts_trimmed": 0}
    gd.trim_drafts(out, {"a": 1}, stats)
    assert out.draft_token_ids == [[1], [4, 5, 6]] and stats["drafts_trimmed"] == 2


@pytest.mark.patched_only
def test_worker_backend_choice(monkeypatch):
    """A multiprocess worker's own backend (a package function: stock has no
    such worker-side backend to compare with). The request's resolved
    `_backend` decides; missing, the configured backend when it is concrete
    (the request's parameters are not changed); lm-format-enforcer turns the
    feature off in the worker, with the reason in the counters' `active`."""
    import copy

    monkeypatch.delenv("VLLM_PATCH_MASKED_DRAFTS", raising=False)
    monkeypatch.delenv("VLLM_PATCH_FORCED_DRAFTS", raising=False)
    monkeypatch.setattr(gd, "find_manager", lambda config: None)
    params = lambda name: SimpleNamespace(  # noqa: E731
        structured_outputs=SimpleNamespace(_backend=name))
    config = lambda name: SimpleNamespace(  # noqa: E731
        structured_outputs_config=SimpleNamespace(backend=name))
    assert gd.backend_name(params("guidance"), config("auto")) == "guidance"
    assert gd.backend_name(params(None), config("xgrammar")) == "xgrammar"
    assert gd.backend_name(params(None), config("auto")) is None

    def requests_with(h, rids, requests, backend):
        out = {}
        for rid in rids:
            sp = copy.copy(h.request(rid).sampling_params)
            if sp.structured_outputs is not None:
                sp.structured_outputs = copy.copy(sp.structured_outputs)
                sp.structured_outputs._backend = backend
            out[rid] = SimpleNamespace(sampling_params=sp, output_token_ids=[])
        return out

    # No resolved backend on the request: the configured one (guidance).
    h, rids, requests = _setup("guidance")
    requests = requests_with(h, rids, requests, None)
    drafter = _drafter(h.vllm_config)
    gd.advance(drafter, requests, rids, [[-1]] * 3, [False] * 3)
    t = drafter.__dict__[gd.TRACKER_ATTR]
    assert type(t.local_manager.backend).__name__ == "GuidanceBackend"
    assert requests[rids[0]].sampling_params.structured_outputs._backend is None
    assert gd.stats(drafter)["shadows"] == 2

    # lm-format-enforcer: off in this worker, no backend built.
    h, rids, requests = _setup("xgrammar")
    requests = requests_with(h, rids, requests, "lm-format-enforcer")
    drafter = _drafter(h.vllm_config)
    gd.advance(drafter, requests, rids, [[-1]] * 3, [False] * 3)
    t = drafter.__dict__[gd.TRACKER_ATTR]
    assert t.reason_off == gd.not_active_backend("lm-format-enforcer")
    assert t.local_manager is None and gd.tracker(drafter) is None
    assert gd.stats(drafter)["active"] == 0


@pytest.mark.patched_only
def test_status_lines_say_where_grammars_live():
    from vllm_patch import envs

    rows = gd.feature_status(envs.settings())
    assert [r["feature"] for r in rows] == ["forced drafts", "masked drafts",
                                            "drafting cost model"]
    assert rows[2]["status"] == "on" and "measured gain" in rows[2]["reason"]
    for r in rows[:2]:
        assert r["status"] == "on", r
        assert "multiprocess workers" in r["reason"], r
        assert "worker-local grammars" in r["reason"], r
        assert "lm-format-enforcer" in r["reason"], r


@pytest.mark.patched_only
def test_refused_token_loses_shadow_quietly(monkeypatch):
    """A shadow out of step refuses a token: the shadow is dropped without
    xgrammar's "Failed to advance FSM ... Please file an issue" ERROR (seen
    in a soak's worker log), and nothing of it is advanced."""
    import vllm.v1.structured_output.backend_xgrammar as bx

    errors = []
    monkeypatch.setattr(bx.logger, "error", lambda *a, **k: errors.append(a))
    h, rids, _ = _setup("xgrammar")
    grammar = h.request(rids[1]).structured_output_request.grammar  # regex abc
    tok = h.tokenizer
    a, b = (tok.encode(c, add_special_tokens=False)[0] for c in "ab")
    assert not gd._accepts(grammar, "r", [b])
    assert gd._accepts(grammar, "r", [a])  # untouched by the refusal
    assert not gd._accepts(grammar, "r", [a, a])
    assert errors == []
    bx.XgrammarGrammar.accept_tokens(grammar, "r", [a])  # what it replaces
    assert errors, "the stock call logs the refusal"


@pytest.mark.patched_only
def test_cost_model_keeps_stock_where_it_cannot_win(monkeypatch):
    """Where the expected gain does not pay for the cost, the batch drafts as
    stock (the forbidden token is drafted), and a feature that keeps not
    paying goes dormant: no shadow is kept, the runner's hook no longer
    reads the sampled tokens, and the requests in flight stay stock."""
    from vllm_patch.v1.spec_decode import draft_cost as dc

    monkeypatch.delenv("VLLM_PATCH_MASKED_DRAFTS", raising=False)
    monkeypatch.delenv("VLLM_PATCH_FORCED_DRAFTS", raising=False)
    monkeypatch.setattr(dc.DraftCost, "expected",
                        lambda self, rows, positions: (0.0, 1.0))
    h, rids, requests = _setup("xgrammar")
    bad = h.tok("x")
    drafter = _drafter(h.vllm_config)
    drafts, _ = _draft(h, drafter, rids, requests, bad)
    t = drafter.__dict__[gd.TRACKER_ATTR]
    assert all(d[0] == bad for d in drafts[:2]), drafts
    assert t.cost.regime == "off" and gd.stats(drafter)["positions"] == 0
    for _ in range(dc.DORMANT_AFTER):
        _draft(h, drafter, rids, requests, bad)
    assert t.cost.regime == "dormant" and not t.shadows
    # While off, only the probes walked (one step in OFF_PROBE_EVERY).
    probed = t.cost.counts["steps_probed"]
    assert probed == dc.DORMANT_AFTER // dc.OFF_PROBE_EVERY - 1 + \
        (dc.DORMANT_AFTER % dc.OFF_PROBE_EVERY != 0), t.cost.counts
    assert gd.stats(drafter)["positions"] == probed * K * 2  # 2 structured
    assert not gd.wants_tokens(drafter)
    syncs = gd.stats(drafter)["d2h_syncs"]
    drafts, _ = _draft(h, drafter, rids, requests, bad)
    assert all(d[0] == bad for d in drafts[:2]) and not t.shadows
    # Dormant: nothing read from the device, nothing walked.
    assert gd.stats(drafter)["d2h_syncs"] == syncs
    assert t.cost.counts["steps_probed"] == probed


def test_forced_continuation_ahead_of_model_drafts(patched, monkeypatch):
    """The grammar's forced text (the object's only key) becomes the first
    drafts, tokenized as the model's tokenizer writes it, whatever the
    drafter prefers; stock drafts the drafter's preference."""
    from vllm_patch.testing.harness import Harness

    monkeypatch.delenv("VLLM_PATCH_MASKED_DRAFTS", raising=False)
    monkeypatch.delenv("VLLM_PATCH_FORCED_DRAFTS", raising=False)
    h = Harness("xgrammar", num_spec_tokens=K, disable_any_whitespace=True)
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"description": {"type": "integer"}},
              "required": ["description"]}
    rid = h.add_request(json=schema)
    h.wait_for_grammar(rid)
    requests = {rid: SimpleNamespace(
        sampling_params=h.request(rid).sampling_params, output_token_ids=[])}
    bad = h.tok("x")
    drafter = _drafter(h.vllm_config)
    drafts, _ = _draft(h, drafter, [rid], requests, bad)
    if not patched:
        assert drafts[0][0] == bad, drafts
        return
    canonical = h.tokenizer.encode('{"description":', add_special_tokens=False)
    n = min(len(canonical), K)
    assert drafts[0][:n] == canonical[:n], (drafts, canonical)
    stats = gd.stats(drafter)
    assert stats["forced_ahead"] >= n, stats
    assert h.grammar(rid).validate_tokens(drafts[0]) == drafts[0]


def _allowed(grammar, vocab):
    words = (vocab + 31) // 32
    mask = torch.full((1, words), -1, dtype=torch.int32)
    grammar.fill_bitmask(mask, 0)
    return mask


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize("accepted", [0, 1, 2])
def test_advance_after_a_walk_matches_the_committed_grammar(
        backend, accepted, patched, monkeypatch):
    """The shadows keep the walked drafts after a propose; the next advance
    keeps what the target committed of them (the accepted drafts, then the
    target's own token) and rolls back the rest. Whatever the target took,
    every shadow then allows exactly what the committed grammar allows."""
    if not patched:
        pytest.skip("no shadows in stock vLLM")
    monkeypatch.delenv("VLLM_PATCH_MASKED_DRAFTS", raising=False)
    monkeypatch.delenv("VLLM_PATCH_FORCED_DRAFTS", raising=False)
    h, rids, requests = _setup(backend)
    vocab = h.vllm_config.model_config.get_vocab_size()
    drafter = _drafter(h.vllm_config)
    drafts, _ = _draft(h, drafter, rids, requests, h.tok("x"))
    t = drafter.__dict__[gd.TRACKER_ATTR]
    walked = {rid: list(t.shadows[rid].path) for rid in rids[:2]}
    assert any(walked.values())  # the walk's drafts are still walked
    sampled = []
    for rid, d in zip(rids, drafts):
        if rid not in walked:
            sampled.append([-1])
            continue
        took = d[:accepted]
        # The target's own token after the accepted drafts: one the
        # committed grammar allows that differs from the next draft.
        g = h.grammar(rid)
        assert g.accept_tokens(rid, took)
        mask = gd.allowed_mask(_allowed(g, vocab), vocab)[0]
        nxt = d[accepted] if accepted < len(d) else None
        allowed = [int(x) for x in mask.nonzero()[:, 0]]
        other = [x for x in allowed if x != nxt] or allowed
        tokens = took + ([other[0]] if other and not g.is_terminated() else [])
        if len(tokens) > len(took):
            assert g.accept_tokens(rid, tokens[len(took):])
        sampled.append(tokens)
    gd.advance(drafter, requests, rids, sampled, [False] * len(rids))
    for rid in rids[:2]:
        sh = t.shadows[rid]
        assert sh.path == []
        assert torch.equal(_allowed(sh.grammar, vocab),
                           _allowed(h.grammar(rid), vocab)), rid


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_grammar_end_inside_a_step_is_an_end_not_a_lost_shadow(
        backend, patched, monkeypatch):
    """A step whose sampled row ends the request part-way (its EOS, or one
    of its stop_token_ids, followed by a draft or the bonus token the
    scheduler then drops: Model Runner V2 keeps k drafts after a grammar's
    end) advances the shadow up to the stop token only: the shadow stands at
    the grammar's end, it is not counted lost (it was counted lost for every
    request whose grammar ended inside a step)."""
    if not patched:
        pytest.skip("no shadows in stock vLLM")
    monkeypatch.delenv("VLLM_PATCH_MASKED_DRAFTS", raising=False)
    monkeypatch.delenv("VLLM_PATCH_FORCED_DRAFTS", raising=False)
    from vllm_patch.testing.harness import Harness

    h = Harness(backend, num_spec_tokens=K, disable_any_whitespace=True)
    a, b, c, x = (h.tok(ch) for ch in "abcx")
    eos = h.tokenizer.eos_token_id
    ends_eos = h.add_request(regex="ab")
    if backend == "xgrammar":
        # xgrammar takes a stop token only where its grammar may end (the
        # stop tokens are compiled in): c ends it after "ab".
        ends_stop = h.add_request(regex="ab", stop_token_ids=[c])
        stop_row = [a, b, c, x]
    else:
        # llguidance may allow a stop token inside: b ends the request
        # where the grammar goes on ("ab+c" allows b or c after "ab").
        ends_stop = h.add_request(regex="ab+c", stop_token_ids=[b])
        stop_row = [a, b, x]
    goes_on = h.add_request(regex="ab+c")
    rids = [ends_eos, ends_stop, goes_on]
    for rid in rids:
        h.wait_for_grammar(rid)
    requests = {rid: SimpleNamespace(
        sampling_params=h.request(rid).sampling_params, output_token_ids=[])
        for rid in rids}
    drafter = _drafter(h.vllm_config)
    gd.advance(drafter, requests, rids, [[-1]] * 3, [False] * 3)
    t = drafter.__dict__[gd.TRACKER_ATTR]
    assert set(t.shadows) == set(rids)
    gd.advance(drafter, requests, rids,
               [[a, b, eos, x], stop_row, [a, b, b]], [False] * 3)
    s = gd.stats(drafter)
    assert s["shadows_lost"] == 0, s
    assert set(t.shadows) == set(rids) and not t.lost
    assert gd._committed_ended(t.shadows[ends_eos])
    assert not gd._committed_ended(t.shadows[goes_on])
    # A token the grammar refuses before any stop token still loses the
    # shadow (out of step: stock drafting from then on).
    gd.advance(drafter, requests, rids, [[-1], [-1], [a]], [False] * 3)
    assert gd.stats(drafter)["shadows_lost"] == 1 and goes_on in t.lost
    # The stop-token request's shadow took the tokens up to the stop token
    # (then the request ends): xgrammar's has ended with it; llguidance's
    # allows what the grammar allows there.
    if backend == "xgrammar":
        assert gd._committed_ended(t.shadows[ends_stop])
        return
    vocab = h.vllm_config.model_config.get_vocab_size()
    g = h.grammar(ends_stop)
    took = stop_row[:stop_row.index(x)]
    assert g.accept_tokens(ends_stop, took)
    assert torch.equal(_allowed(t.shadows[ends_stop].grammar, vocab),
                       _allowed(g, vocab))


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_whole_batch_drafts_from_candidates(backend, patched, monkeypatch):
    """A batch whose every row walks its grammar, with top-k candidates up
    front (the accelerator's path): the drafts come from the candidates'
    first column (no argmax of the drafter's own) and only the rows whose
    choice differs are written back. The drafts equal the CPU path's (its
    argmax, then the candidates of the rows that refused it), both where the
    drafter prefers a forbidden token at every position and where it
    prefers exactly the drafts the grammar allows (nothing to write back)."""
    if not patched:
        pytest.skip("no grammar-aware drafting in stock vLLM")
    monkeypatch.delenv("VLLM_PATCH_MASKED_DRAFTS", raising=False)
    monkeypatch.delenv("VLLM_PATCH_FORCED_DRAFTS", raising=False)
    h, rids, requests = _setup(backend)
    rids = rids[:2]  # the structured rows only
    requests = {rid: requests[rid] for rid in rids}
    vocab = h.vllm_config.model_config.get_vocab_size()

    def run(upfront, prefer):
        monkeypatch.setattr(gd, "CANDIDATES_UPFRONT", upfront)
        drafter = _drafter(h.vllm_config)
        gen = torch.Generator().manual_seed(0)
        gd.advance(drafter, requests, rids, [[-1]] * 2, [False] * 2)
        gd.begin(drafter, 2)
        cols = []
        try:
            for pos in range(K):
                logits = torch.randn(2, vocab, generator=gen)
                for r in range(2):
                    logits[r, prefer(r, pos)] = 100.0
                ids, _ = drafter._sample_draft_tokens(
                    logits, SimpleNamespace(all_greedy=True))
                cols.append(ids.tolist())
        finally:
            gd.end(drafter)
        return [list(c) for c in zip(*cols)], gd.stats(drafter)

    bad = h.tok("x")
    lazy, _ = run(False, lambda r, pos: bad)
    upfront, stats = run(True, lambda r, pos: bad)
    assert upfront == lazy, (upfront, lazy)
    assert stats["positions"] > 0
    for rid, d in zip(rids, upfront):
        assert h.grammar(rid).validate_tokens(d) == d
    # The drafter prefers the valid drafts themselves: every first
    # candidate is taken, nothing written back, the same drafts.
    writes = []
    real = gd._to_device

    def spy(t, values, device):
        writes.append(list(values))
        return real(t, values, device)

    monkeypatch.setattr(gd, "_to_device", spy)
    again, _ = run(True, lambda r, pos: lazy[r][pos])
    assert again == lazy
    assert writes == [], writes


@pytest.mark.patched_only
def test_gain_is_each_walked_request_speed_up(monkeypatch):
    """What the cost model is told a walk gained: per walked request, the
    drafts it accepted after the first changed position (g) over the tokens
    it would have committed without the walk (t - g), summed; and the
    batch's requests that committed tokens (not its tokens: a request that
    walks passes faster through the parts of its output where the walk
    helps, so a ratio of tokens undercounts what it saves)."""
    monkeypatch.delenv("VLLM_PATCH_MASKED_DRAFTS", raising=False)
    monkeypatch.delenv("VLLM_PATCH_FORCED_DRAFTS", raising=False)
    h, rids, requests = _setup("xgrammar")
    drafter = _drafter(h.vllm_config)
    drafts, _ = _draft(h, drafter, rids, requests, h.tok("x"))
    t = drafter.__dict__[gd.TRACKER_ATTR]
    assert set(t.changed) == set(rids[:2]), t.changed
    # The json row's walk changed its second draft, the regex row's first.
    t.changed[rids[0]], t.changed[rids[1]] = 1, 0
    seen = []
    monkeypatch.setattr(t.cost, "observe",
                        lambda requests_, gain, *a, **kw: seen.append((requests_, gain)))
    # json: 3 drafts accepted + the target's token (t=4, g=3-1=2: 2/2);
    # regex: 1 accepted + 1 (t=2, g=1: 1/1); unstructured: 1 token.
    sampled = [drafts[0][:3] + [drafts[0][3]], drafts[1][:1] + [drafts[1][1]],
               [drafts[2][0]]]
    gd.advance(drafter, requests, rids, sampled, [False] * 3)
    assert seen == [(3, pytest.approx(2 / 2 + 1 / 1))]


@pytest.mark.patched_only
def test_verification_row_priced_as_the_scheduler_walks_it(monkeypatch):
    """A verification row's price is a fill, an accept and a one-token
    rollback on the shadow's grammar, as the scheduler's walk does per
    scheduled position; the shadow is left where it was."""
    monkeypatch.delenv("VLLM_PATCH_MASKED_DRAFTS", raising=False)
    h, rids, requests = _setup("xgrammar")
    drafter = _drafter(h.vllm_config)
    _draft(h, drafter, rids, requests, h.tok("x"))
    t = drafter.__dict__[gd.TRACKER_ATTR]
    shadow = t.shadows[rids[0]]
    gd._rollback_each([shadow])
    calls = []
    grammar = shadow.grammar
    for name in ("fill_bitmask", "accept_tokens", "rollback"):
        inner = getattr(grammar, name)
        monkeypatch.setattr(grammar, name, lambda *a, _n=name, _f=inner:
                            calls.append(_n) or _f(*a))
    before = grammar.num_processed_tokens
    samples = len(t.cost.fill_samples)
    assert gd._time_row_fill(t, shadow)
    assert calls == ["fill_bitmask", "accept_tokens", "rollback"]
    assert grammar.num_processed_tokens == before
    assert len(t.cost.fill_samples) == samples + 1 and t.cost.row_fill_ns > 0
