"""Property-based fuzzing of grammar x spec decode x scheduling over the
real scheduler (vllm_patch.testing.fuzz).

Patched: no invariant violation and no escaping exception in any episode
(hypothesis shrinks a failure; add the shrunk episode to regressions/).
Stock (VLLM_PATCH_DISABLE=1): the same budget must find G2's failures
(post_terminal and grammar_prefix) and nothing the patches do not remove,
so this test can fail.

Episodes include KV-connector episodes (NixlConnector scheduler side,
simulated worker: loads and sends, failures with kv_load_failure_policy
fail / recompute, aborts while a transfer is pending), held / failing
grammar compiles, and reasoning episodes (deepseek_r1 parser, the grammar
starts after </think>); the patched test checks that the budget covers them.

Budget: VLLM_PATCH_FUZZ_EXAMPLES episodes (default 400, about a minute per
mode per vLLM version on 2 idle cores); derandomized for CI
reproducibility.

Grammar-aware draft source (`fuzz.episodes("grammar")`: the drafts the
scheduler sees come from grammar-aware drafting's own code, masked and
forced drafts and the forced continuation over shadow grammars, on real
JSONSchemaBench schemas too): the same two properties over
VLLM_PATCH_FUZZ_GRAMMAR_EXAMPLES episodes (default 30, 2-15 s per
mode per vLLM version); the patched test also checks that the drafting
code's paths ran (masked, forced, forced continuation, drafts trimmed
after the grammar's end, xgrammar's batched calls, both backends, both
schedulers). Longer campaigns: benchmarks/fuzz_campaign.py --drafts grammar.
"""

from __future__ import annotations

import collections
import os

import pytest

from vllm_patch.patching import version_series, vllm_version

pytestmark = [pytest.mark.scheduler, pytest.mark.usefixtures("quiet_vllm_patch_log")]

EXAMPLES = int(os.environ.get("VLLM_PATCH_FUZZ_EXAMPLES", "400"))
GRAMMAR_EXAMPLES = int(os.environ.get("VLLM_PATCH_FUZZ_GRAMMAR_EXAMPLES", "30"))


def _run(on_result, shrink: bool, drafts: str = "random",
         examples: int = EXAMPLES) -> None:
    from hypothesis import HealthCheck, Phase, given, settings

    from vllm_patch.testing import fuzz

    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])

    @settings(max_examples=examples, deadline=None, derandomize=True,
              database=None, phases=phases, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(fuzz.episodes(drafts))
    def run(spec):
        on_result(spec, fuzz.run_episode(spec))

    run()


def _coverage(spec, seen: collections.Counter) -> None:
    seen["episodes"] += 1
    seen[f"kv={spec.kv}"] += 1
    seen[f"reasoning={spec.reasoning}"] += 1
    for rs in spec.requests:
        if spec.kv and rs.remote:
            seen[f"remote={rs.remote}"] += 1
            if rs.kv_fail:
                seen[f"kv_fail={rs.kv_fail}"] += 1
            if rs.abort_at is not None and rs.remote == 1:
                seen["abort_remote"] += 1
        if rs.hold_grammar is not None and rs.grammar is not None:
            seen["held_grammar"] += 1
        if spec.reasoning and rs.grammar is not None:
            seen[f"think={rs.think}"] += 1


def test_fuzz_patched_no_violation(patched):
    if not patched:
        pytest.skip("patched property; stock run: test_fuzz_stock_breaks")
    seen: collections.Counter[str] = collections.Counter()

    def check(spec, res):
        _coverage(spec, seen)
        assert not res.violations, (
            f"{len(res.violations)} violation(s), first: "
            f"{res.violations[0]}\nepisode: {spec!r}")

    _run(check, shrink=True)
    print(f"patched: coverage {dict(seen)}")
    if EXAMPLES >= 200:
        # The budget reaches every episode family: KV-connector episodes
        # (both failure policies, decode and prefill side, every failure
        # kind, aborts while a transfer may be pending), held grammar
        # compiles, reasoning episodes (every think kind).
        want = ["kv=fail", "kv=recompute", "remote=1", "remote=2",
                "kv_fail=blocks", "kv_fail=request", "kv_fail=nixl",
                "abort_remote", "held_grammar", "reasoning=True",
                "think=0", "think=1", "think=2", "think=3"]
        missing = [k for k in want if not seen[k]]
        assert not missing, (missing, dict(seen))


def test_fuzz_stock_breaks(patched, native):
    if patched:
        pytest.skip("stock run only (VLLM_PATCH_DISABLE=1)")
    counts: collections.Counter[str] = collections.Counter()
    episodes = [0]

    def record(spec, res):
        episodes[0] += 1
        counts.update(res.properties())

    _run(record, shrink=False)
    print(f"stock: {episodes[0]} episodes; episodes violating: {dict(counts)}")
    _check_stock_breaks(counts, native)


def _check_stock_breaks(counts, native) -> None:
    """The properties a stock run breaks: only G2's."""
    if "G2" in native:
        # A patched build carrying G2: its own code holds every property
        # stock breaks here (all G2's).
        assert not counts, dict(counts)
        return
    # G2 on stock: tokens after the grammar's end and grammar-invalid tokens
    # are committed (and the grammar is left out of step with them).
    assert {"post_terminal", "grammar_prefix"} <= counts.keys(), dict(counts)
    # Nothing else: stock holds every KV-lifecycle property; only 0.32 also
    # leaves num_computed_tokens above num_tokens when it trims a step's
    # tokens (G2's 0.32 rollback).
    removed = {"post_terminal", "grammar_prefix", "grammar_sync"}
    if version_series(vllm_version()) == "0.32":
        removed.add("computed_le_tokens")
    assert counts.keys() <= removed, dict(counts)


def _grammar_source():
    from vllm_patch.testing import fuzz, jsonschemabench

    if not fuzz.jsb_grammars():
        pytest.skip(jsonschemabench.MISSING)


def test_fuzz_grammar_drafts_patched_no_violation(patched):
    if not patched:
        pytest.skip("patched property; stock run: "
                    "test_fuzz_grammar_drafts_stock_breaks")
    _grammar_source()
    seen: collections.Counter[str] = collections.Counter()
    drafted: collections.Counter[str] = collections.Counter()

    def check(spec, res):
        seen["episodes"] += 1
        seen[f"backend={spec.backend}"] += 1
        seen[f"async={spec.async_scheduling}"] += 1
        seen[f"compact={spec.compact}"] += 1
        seen["jsb"] += sum(rs.jsb is not None for rs in spec.requests)
        drafted.update(res.draft_stats)
        assert not res.violations, (
            f"{len(res.violations)} violation(s), first: "
            f"{res.violations[0]}\nepisode: {spec!r}")

    _run(check, shrink=True, drafts="grammar", examples=GRAMMAR_EXAMPLES)
    print(f"patched, grammar-aware drafts: coverage {dict(seen)}; "
          f"drafting {dict(drafted)}")
    if GRAMMAR_EXAMPLES >= 30:
        want = ["backend=xgrammar", "backend=guidance", "async=True",
                "async=False", "compact=True", "jsb"]
        assert not [k for k in want if not seen[k]], dict(seen)
        # The drafting code's paths ran: masked and forced drafts, the
        # forced continuation (drafted and accepted), drafts trimmed after
        # the grammar's end, xgrammar's batched calls with results read in
        # one call.
        for key in ("positions", "masked_changed", "forced", "forced_ahead",
                    "forced_ahead_accepted", "ended", "drafts_trimmed",
                    "xgr_batch_accept_calls"):
            assert drafted[key] > 0, (key, dict(drafted))
        assert drafted["xgr_flags_slow"] == 0, dict(drafted)


def test_fuzz_grammar_drafts_stock_breaks(patched, native):
    if patched:
        pytest.skip("stock run only (VLLM_PATCH_DISABLE=1)")
    _grammar_source()
    counts: collections.Counter[str] = collections.Counter()
    episodes = [0]

    def record(spec, res):
        episodes[0] += 1
        counts.update(res.properties())

    _run(record, shrink=False, drafts="grammar", examples=GRAMMAR_EXAMPLES)
    print(f"stock, grammar-aware drafts: {episodes[0]} episodes; episodes "
          f"violating: {dict(counts)}")
    # Under these drafts too, stock commits tokens after the grammar's end
    # and grammar-invalid tokens (G2), and nothing the patches do not remove.
    _check_stock_breaks(counts, native)
