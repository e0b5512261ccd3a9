"""Shared fixtures. Every test module runs under one mode per pytest process:
patched (default) or stock (VLLM_PATCH_DISABLE=1); scripts/test.sh runs both.
Guarantee tests assert the guarantee when patched and the failure it removes
when stock, so no guarantee test can pass by accident."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# The runtime invariant checker is on in every test, a violation
# raises (an explicit VLLM_PATCH_CHECK_INVARIANTS / _RAISE in the environment
# wins). Nothing is applied in the stock run (VLLM_PATCH_DISABLE=1).
os.environ.setdefault("VLLM_PATCH_CHECK_INVARIANTS", "1")
os.environ.setdefault("VLLM_PATCH_INVARIANTS_RAISE", "1")

import vllm_patch  # noqa: E402
from vllm_patch import envs  # noqa: E402

# Patch vLLM's classes before any test builds a scheduler, as vLLM's plugin
# loader does in a real engine process.
vllm_patch.register()


def pytest_collection_modifyitems(config, items):
    # The stock run exists to show the failures the patches remove. A control
    # (stock behaves the same, measured) or a package feature that does not
    # depend on the patches would only repeat the patched run there.
    if not envs.settings().disable:
        return
    skip = pytest.mark.skip(reason="patched run only: a control or a feature "
                            "that does not depend on the patches (no failure "
                            "for the stock run to show)")
    for item in items:
        if item.get_closest_marker("patched_only"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def patched() -> bool:
    """True when the patches are on; False for the stock (disabled) run."""
    return not envs.settings().disable


@pytest.fixture(scope="session")
def native() -> frozenset[str]:
    """What this vLLM carries natively: the guarantees a patched vLLM build
    carries whole and the plugin patches its series replaces (empty on a
    release). With the plugin off (the stock run) a test expects the build's
    own code to hold these, so the scheduler tier runs on a build as it does
    on the release (the series tier runs it there)."""
    from vllm_patch import series

    return frozenset(series.native_guarantees()) | \
        frozenset(series.native_patch_ids())


@pytest.fixture
def plugin_g2(native) -> None:
    """For tests of the plugin's own G2 code: skipped on a vLLM build that
    carries G2, where the plugin does not apply it (vLLM's own code holds G2
    there, with the series' own tests)."""
    if "G2" in native:
        pytest.skip("tests the plugin's G2 code, which a vLLM build carrying "
                    "G2 does not apply")


@pytest.fixture
def plugin_g1(native) -> None:
    """For tests of the plugin's own G1 code (its in-flight queue, the
    runtime safety net, Model Runner V2's per-step drafts): skipped on a
    vLLM build that carries G1, where the plugin applies none of G1's
    patches (the build's scheduler holds G1 on the V1 runner, with the
    series' own tests; on Model Runner V2 status reads it not enforced)."""
    if "G1" in native:
        pytest.skip("tests the plugin's G1 code, which a vLLM build carrying "
                    "G1 does not apply")


@pytest.fixture
def check_scenario(patched, native):
    """Run a conformance scenario as a guarantee test: patched (and every
    control) must hold; stock must report exactly the violations the
    scenario declares (`Scenario.stock_violations`): the failure the patch
    removes, not just any failure. Stock on a patched vLLM build that
    carries the scenario's guarantee must hold too."""
    from vllm_patch.patching import version_series, vllm_version

    series = version_series(vllm_version())

    def check(scenario) -> list[str]:
        if series not in scenario.series:
            pytest.skip(f"scenario is for vLLM {scenario.series}")
        violations = scenario.run()
        if patched or not scenario.stock_fails or scenario.guarantee in native:
            assert violations == []
        else:
            expected = scenario.expected_stock(series)
            assert expected, (f"{scenario.name} declares no stock violations "
                              f"for vLLM {series}")
            assert violations == expected, (
                f"stock vLLM {series} does not fail {scenario.guarantee} as "
                f"{scenario.name} expects")
        return violations

    return check


@pytest.fixture
def quiet_vllm_patch_log():
    """Silence vllm_patch's logger: fuzz episodes make expected G2/stock error
    lines by the thousand. Opt-in per module (tests asserting on log lines
    must not get it)."""
    import logging

    lg = logging.getLogger("vllm_patch")
    old = lg.level
    lg.setLevel(logging.CRITICAL)
    yield
    lg.setLevel(old)
