"""G3 end to end: a real vLLM 0.32 engine on the CPU with async scheduling
(restored by the test-only switch VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING=1;
the CPU platform turns it off), the tiny local model with `draft_model` (the
target as its own draft, greedy: drafts accepted ~100 %) and the trained
tiny EAGLE-1 head, k = 3..5, xgrammar, JSON schema / regex / choice requests
with ignore_eos true and false, logprobs on, plus unstructured requests in
the same batch.

Under async scheduling the V1 runner verifies its OWN drafts, not the
scheduler's -1-padded copy, so on stock drafts after the grammar's end meet
all-ones bitmask rows and are accepted (audit P3).

Patched: every structured output valid, no token after the grammar's end,
finish "stop", one logprob row per token; the engine's spec-decode counters
(raw: G2's `g2-spec-stats-cap` is skipped in this test, so they show what
the worker really accepted) never count more accepted than drafted tokens,
per position too; the
drafter is skipped in steps where every request's grammar ends
(`g3-no-drafts-after-grammar-end`, counters read from the worker process),
with no misprediction (the unstructured requests in the batch keep it
running while they run; their output identity with stock is checked by
tests/e2e/test_g2_engine.py, which runs with these patches applied).
Stock (VLLM_PATCH_DISABLE=1; only the test-only async switch applied): with
draft_model the worker accepts more tokens than were drafted (its own
post-terminal drafts), and every ignore_eos request runs on past its
grammar's end. One sync config shows the drafter skip without async
scheduling.

In-process and multiprocess engine modes (in the latter the plugin must be
active in the worker process: its patch outcomes are read there).

    python -m pytest tests/e2e/test_g3_engine.py -m e2e -q -s
    VLLM_PATCH_DISABLE=1 python -m pytest tests/e2e/test_g3_engine.py -m e2e -q -s
"""

from __future__ import annotations

import collections
import os

import pytest

import vllm_patch
from vllm_patch.patching import REGISTRY, State
from vllm_patch.testing.workload import CHOICES, REGEX, valid
from vllm_patch.testing import engine, tiny_model
from vllm_patch.v1.spec_decode.grammar_end import draft_skip_stats

pytestmark = pytest.mark.e2e

FORCE_ASYNC = "cpu-force-async-scheduling"
RAW_STATS = "g2-spec-stats-cap"
G3_WORKER_PATCHES = ("g3-v1-runner-acceptable-drafts",
                     "g3-no-drafts-after-grammar-end",
                     "g3-no-drafts-handed-over-after-grammar-end")
MAX_TOKENS = 64


@pytest.fixture
def forced_async(monkeypatch):
    """Async scheduling on the CPU engine, patched and stock alike: the
    test-only switch obeys only its own variable, also under
    VLLM_PATCH_DISABLE=1 (patching.disabled), in this process (which builds
    the config, so runs the CPU platform hook) and in the engine processes."""
    from vllm.plugins import load_general_plugins

    monkeypatch.setenv("VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING", "1")
    # Raw spec-decode counters: G2's stats cap would hide what the worker
    # accepted (it caps accepted at the real drafts). Engine processes
    # inherit the variable; this process re-registers below.
    skip_before = os.environ.get("VLLM_PATCH_SKIP")
    monkeypatch.setenv("VLLM_PATCH_SKIP",
                       ",".join(filter(None, [skip_before, RAW_STATS])))
    # vLLM runs the plugin (register()) once per process, at the first
    # engine: let it run now, then re-register with the variables above.
    load_general_plugins()
    vllm_patch.register()
    assert REGISTRY.outcomes[FORCE_ASYNC].state is State.APPLIED
    try:
        yield
    finally:
        monkeypatch.delenv("VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING")
        if skip_before is None:
            monkeypatch.delenv("VLLM_PATCH_SKIP")
        else:
            monkeypatch.setenv("VLLM_PATCH_SKIP", skip_before)
        vllm_patch.register()
        assert REGISTRY.outcomes[FORCE_ASYNC].state is not State.APPLIED


def _requests():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams as SO

    kinds = {"json": SO(json=engine.JSON_SCHEMA), "choice": SO(choice=CHOICES),
             "regex": SO(regex=REGEX)}
    structured = [((kind, ie), p, SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=ie, logprobs=1,
        structured_outputs=so))
        for ie in (True, False) for kind, so in kinds.items()
        for p in engine.PROMPTS]
    # Plain requests short enough to finish before the structured ones: the
    # batch's drafter skip needs a tail where only ending requests remain.
    # With grammar-aware drafting the structured requests draft as well as
    # plain text, and at max_tokens=32 they finished first (no tail).
    plain = [(("plain", ie), p, SamplingParams(temperature=0, max_tokens=8,
                                               ignore_eos=ie, logprobs=1))
             for ie in (True, False) for p in engine.PROMPTS[:2]]
    return structured, plain


def _spec_config(method: str, k: int) -> dict:
    draft = (tiny_model.build_target() if method == "draft_model"
             else tiny_model.build_eagle(trained=True))
    return {"method": method, "model": str(draft), "num_speculative_tokens": k}


def _run(method: str, k: int, async_: bool, one_at_a_time: bool):
    structured, plain = _requests()
    reqs = structured + plain
    llm = engine.start_llm(speculative_config=_spec_config(method, k),
                           async_scheduling=async_)
    try:
        workers = engine.worker_probe(llm)
        stats0 = llm.collective_rpc(draft_skip_stats)
        before = engine.spec_decode_counts(llm)
        outs = llm.generate([p for _, p, _ in reqs], [sp for _, _, sp in reqs],
                            use_tqdm=False)
        stats1 = llm.collective_rpc(draft_skip_stats)
        # Latency case: one structured request at a time (the batch is then
        # only that request, so the steps at its grammar's end skip drafting).
        single = [r for r in structured
                  if one_at_a_time and r[1] == engine.PROMPTS[0]]
        single_outs = [llm.generate([p], [sp], use_tqdm=False)[0]
                       for _, p, sp in single]
        spec = engine.counts_delta(engine.spec_decode_counts(llm), before)
        stats2 = llm.collective_rpc(draft_skip_stats)
    finally:
        engine.stop_llm(llm)
    batch_skip = _delta(stats1, stats0)
    single_skip = _delta(stats2, stats1)
    single_skip["requests"] = len(single)
    return (structured + single, outs[:len(structured)] + single_outs,
            outs[len(structured):], spec, batch_skip, single_skip, workers)


def _delta(after, before) -> dict[str, int]:
    return {key: sum(s[key] for s in after) - sum(s[key] for s in before)
            for key in after[0]}


def _check(structured, outs):
    counts: collections.Counter = collections.Counter()
    problems: dict[bool, list[str]] = {True: [], False: []}
    for ((kind, ignore_eos), prompt, _), out in zip(structured, outs):
        c = out.outputs[0]
        bad = engine.tally_completion(counts, valid(kind, c.text), c)
        if bad:
            problems[ignore_eos].append(f"{kind} {prompt!r}: {'; '.join(bad)}")
    return counts, problems


def _spec_problems(spec) -> list[str]:
    """accepted <= drafted, overall and per position (position i cannot be
    accepted more often than there were drafts, nor more often than i-1)."""
    bad = []
    if spec["accepted"] > spec["draft_tokens"]:
        bad.append(f"accepted {spec['accepted']} > drafted {spec['draft_tokens']}")
    per = spec["per_pos"]
    if any(n > spec["drafts"] for n in per):
        bad.append(f"per position {per} > drafts {spec['drafts']}")
    if any(b > a for a, b in zip(per, per[1:])):
        bad.append(f"per position {per} not non-increasing")
    return bad


CONFIGS = {
    # mode: [(method, k, async scheduling)]; k = 3..5. The sync config shows
    # the drafter skip there too (patched run only: P3 needs async).
    "inproc": [("draft_model", 3, True), ("eagle", 4, True),
               ("draft_model", 4, False)],
    "mp": [("draft_model", 5, True)],
}


@pytest.mark.timeout(600)
def test_g3_engine(engine_mode, forced_async, patched, native):
    # A patched vLLM build carrying G3 (and G2, whose cut the ignore_eos
    # requests need) holds both with the plugin off: its stock run checks the
    # outputs and the spec-decode counters as the patched run does (the
    # drafter-skip counters are the plugin's, so not read there).
    build = not patched and {"G2", "G3"} <= native
    for method, k, async_ in CONFIGS[engine_mode]:
        if not (patched or async_):
            continue
        # Stock: no one-at-a-time phase (it only measures the drafter skip;
        # stock ignore_eos requests would run to max_tokens one by one).
        structured, outs, plain_outs, spec, skip, single, workers = _run(
            method, k, async_, one_at_a_time=patched)
        counts, problems = _check(structured, outs)
        spec_bad = _spec_problems(spec)
        mode = "patched" if patched else "stock, G3 native" if build else "stock"
        print(f"\nG3-E2E {mode} {engine_mode} "
              f"{'async' if async_ else 'sync'} {method} k={k}: "
              f"valid {counts['valid']}/{counts['requests']}, "
              f"post-grammar tokens {counts['post_grammar_tokens']}, finish "
              f"{ {c: n for c, n in counts.items() if c.startswith('finish')} }, "
              f"spec {spec['accepted']}/{spec['draft_tokens']} accepted/drafted "
              f"in {spec['drafts']} drafts (per pos {spec['per_pos']}), "
              f"drafter batch {skip}, drafter one-at-a-time {single}, failing "
              f"ignore_eos={len(problems[True])} "
              f"no-ignore_eos={len(problems[False])} {spec_bad}")
        assert all(w["use_async_scheduling"] == async_ for w in workers), workers
        if engine_mode == "mp":
            assert all(w["pid"] != os.getpid() for w in workers)
        assert all(len(o.outputs[0].token_ids) > 0 for o in plain_outs)
        if not patched:
            assert all(w["disabled"] for w in workers)
            assert skip["skipped_calls"] == skip["proposer_calls"] == 0
            assert single["skipped_calls"] == single["proposer_calls"] == 0
            if build:
                assert problems == {True: [], False: []}
                assert spec_bad == []
                assert spec["draft_tokens"] > 0
                continue
            # Every ignore_eos request runs on past its grammar's end (G2);
            # the others are right on stock too (control).
            ignoring = sum(ie for (_, ie), _, _ in structured)
            assert len(problems[True]) == ignoring, problems[True]
            assert all("token(s) after the grammar's end" in p
                       for p in problems[True]), problems[True]
            assert problems[False] == []
            if method == "draft_model" and async_:
                # P3 itself: the worker accepted its own post-terminal drafts
                # (greedy draft == target, so they always match). The tiny
                # EAGLE head's drafts rarely match, which hides it there.
                assert spec["accepted"] > spec["draft_tokens"], spec
            continue
        # The plugin is active in the worker process (mp: another process).
        for w in workers:
            for name in G3_WORKER_PATCHES:
                assert w["outcomes"][name] == State.APPLIED.value, w
            assert w["outcomes"][RAW_STATS] == State.SKIPPED_BY_USER.value, w
        assert problems == {True: [], False: []}
        assert spec_bad == []
        assert spec["draft_tokens"] > 0
        # The drafter was skipped in steps where every request had ended
        # (async: in the batch too, at its tail), never for one that went on.
        assert skip["skipped_calls"] > 0 or not async_, skip
        # One request at a time: every request's last step skips drafting
        # (async: also its in-flight follow-up step).
        assert single["skipped_calls"] >= single["requests"], single
        assert skip["mispredicted"] == single["mispredicted"] == 0
