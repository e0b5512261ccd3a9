"""Issue 8: property-based fuzzing of grammar x spec decode x scheduling
over the real scheduler (vllm_patch.testing.fuzz).

Patched: no invariant violation and no escaping exception in any episode
(hypothesis shrinks a failure; add the shrunk episode to regressions/).
Stock (VLLM_PATCH_DISABLE=1): the same budget must find violations (G2:
post_terminal / grammar_prefix), so this test can fail.

Budget: VLLM_PATCH_FUZZ_EXAMPLES episodes (default 400, about a minute per
mode per vLLM version on 2 cores); derandomized for CI reproducibility.
"""

from __future__ import annotations

import collections
import logging
import os

import pytest

pytestmark = pytest.mark.scheduler

EXAMPLES = int(os.environ.get("VLLM_PATCH_FUZZ_EXAMPLES", "400"))


def _run(on_result, shrink: bool) -> None:
    from hypothesis import HealthCheck, Phase, given, settings

    from vllm_patch.testing import fuzz

    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              database=None, phases=phases, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(fuzz.episodes())
    def run(spec):
        on_result(spec, fuzz.run_episode(spec))

    run()


@pytest.fixture(autouse=True)
def _quiet():
    # Expected G2/stock error lines would flood the log.
    lg = logging.getLogger("vllm_patch")
    old = lg.level
    lg.setLevel(logging.CRITICAL)
    yield
    lg.setLevel(old)


def test_fuzz_patched_no_violation(patched):
    if not patched:
        pytest.skip("patched property; stock run: test_fuzz_stock_breaks")

    def check(spec, res):
        assert not res.violations, (
            f"{len(res.violations)} violation(s), first: "
            f"{res.violations[0]}\nepisode: {spec!r}")

    _run(check, shrink=True)


def test_fuzz_stock_breaks(patched):
    if patched:
        pytest.skip("stock run only (VLLM_PATCH_DISABLE=1)")
    counts: collections.Counter[str] = collections.Counter()
    episodes = [0]

    def record(spec, res):
        episodes[0] += 1
        counts.update(res.properties())

    _run(record, shrink=False)
    print(f"stock: {episodes[0]} episodes; episodes violating: {dict(counts)}")
    assert counts, f"stock vLLM broke no property in {episodes[0]} episodes"
    # G2 on stock: tokens after the grammar's end / grammar-invalid tokens
    # are committed.
    assert counts.keys() & {"post_terminal", "grammar_prefix"}
