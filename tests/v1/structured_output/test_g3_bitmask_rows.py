"""G3: bitmask rows after a grammar's end / after an invalid draft, and
`num_acceptable_drafts` honoured by the V1 runner (scheduler tier).

Patched: rows after a terminal draft allow only the grammar's stop tokens,
rows after the first -1 draft are the valid-prefix row, and the V1 runner
accepts no draft at or after num_acceptable_drafts. Stock
(VLLM_PATCH_DISABLE=1): those rows are all-ones and the runner accepts
post-terminal drafts; each test asserts the stock failure.
"""

from __future__ import annotations

import pytest

from vllm_patch.conformance import g3

pytestmark = pytest.mark.scheduler

@pytest.mark.parametrize("scenario", g3.SCENARIOS, ids=lambda s: s.name)
def test_g3_scenario(scenario, check_scenario):
    check_scenario(scenario)


def _full(h, row) -> bool:
    return len(h.allowed(row)) == len(h.tokenizer)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_rows_and_acceptable_drafts_in_a_mixed_batch(patched, native, async_):
    """Three structured requests and one plain one in the same step (checks
    the 0.32 cumulative / 0.33 strided row layout): T reaches its terminal at
    draft 1, V has an invalid draft at 1, N is all valid, U is unstructured."""
    from vllm_patch.testing.harness import EOS, Harness

    h = Harness("xgrammar", num_spec_tokens=3, async_scheduling=async_)
    a, b, c, x = (h.tok(t) for t in "abcx")
    t = h.add_request(regex="ab", ignore_eos=True)
    v = h.add_request(regex="abc")
    n = h.add_request(regex="abcab")
    u = h.add_request(ignore_eos=True)
    worker = {t: [b, EOS, c], v: [b, x, c], n: [b, c, a], u: [x, x, x]}
    target = {t: [b, EOS, c, c], v: [b, x, c, c], n: [b, c, a, b],
              u: [x, x, x, x]}
    if async_:
        h.launch()
        h.launch(drafts=worker)
        h.finish_oldest({r: [a] for r in (t, v, n)} | {u: [x]})
        record, go, sampled = g3.sample_step(h, worker, target, async_=True)
        spec = record.spec_tokens
        assert spec[t] == [b, EOS, -1] and spec[v] == [b, -1, -1]
    else:
        h.step({r: [a] for r in (t, v, n)} | {u: [x]}, drafts=worker)
        record, go, sampled = g3.sample_step(h, {}, target, async_=False)
        spec = record.spec_tokens
        assert spec[t] == [b, EOS] and spec[v] == [b]  # validated, truncated
    acc = record.num_acceptable_drafts
    assert acc[t] == 2 and acc[v] == 1 and acc[n] == 3 and u not in acc
    rows = record.bitmask_rows
    post_terminal = [rows[t][i] for i in range(2, len(rows[t]))]
    assert post_terminal  # async: row 2 + bonus; sync: the bonus row
    # N (no terminal, no invalid) is identical patched and stock.
    for row, tok in zip(rows[n], [b, c, a, b]):
        assert tok in h.allowed(row) and not _full(h, row)
    assert h.allowed(rows[v][1]) == [c]  # first invalid: valid-prefix row
    if patched or "G3" in native:  # a build carrying G3: its own rows
        for r in post_terminal:
            assert h.allowed(r) == [EOS, 3]  # stop tokens only (EOS, im_end)
        for r in rows[v][2:]:
            assert h.allowed(r) == [c]
        assert len(sampled[t]) <= 3 and sampled[t][2:] in ([], [EOS])
        assert sampled[v] == [b, c]
    else:
        assert all(_full(h, r) for r in post_terminal)  # stock: all-ones
        if async_:
            assert all(_full(h, r) for r in rows[v][2:])
            assert sampled[t] == [b, EOS, c, c]  # post-terminal draft accepted
        else:
            assert sampled[t] == [b, EOS, c]     # bonus after terminal: free
    assert sampled[n] == [b, c, a, b]
    assert sampled[u] == [x, x, x, x]
    d, acc_total, _ = h.spec_totals()
    if patched:
        assert acc_total <= d
    h.drain()


def test_terminated_at_step_start_keeps_stock_row(patched, monkeypatch):
    """With VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION=0 a terminated grammar
    keeps running: its rows stay stock (all-ones), so the opt-out's stock
    continuation is unchanged; its worker drafts are still never accepted."""
    from vllm_patch import patching
    from vllm_patch.testing.harness import EOS, Harness

    if patching.guarantee_native("G2"):
        pytest.skip("this vLLM build stops at the grammar's end itself (G2 "
                    "native): the switch has no effect, no grammar runs on "
                    "past its end")
    monkeypatch.setenv("VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION", "0")
    h = Harness("xgrammar", num_spec_tokens=2, async_scheduling=True)
    a, b, x = (h.tok(t) for t in "abx")
    rid = h.add_request(regex="ab", ignore_eos=True)
    h.launch()
    h.launch(drafts={rid: [b, EOS]})
    h.finish_oldest({rid: [a]})
    h.launch(drafts={rid: [x, x]})
    g3.sample_step(h, {rid: [b, EOS]}, {rid: [b, EOS, EOS]}, async_=True)
    assert h.grammar(rid).is_terminated()
    record, go, sampled = g3.sample_step(h, {rid: [x, x]}, {rid: [x, x, x]},
                                         async_=True)
    assert record.num_acceptable_drafts[rid] == 0
    assert all(_full(h, r) for r in record.bitmask_rows[rid])
    assert sampled[rid] == ([x] if patched else [x, x, x])
    h.drain()
