"""G2's per-request update is an inline copy of the stock body when vLLM's
source is exactly the audited 0.32.0 / 0.33.0 one (no call layer per request,
for the per-request overhead), and a wrapper around the stock method
otherwise (a vLLM patch release that edits the method). Both must keep G2:
this runs every G2 conformance scenario through the wrapping fallback."""

from __future__ import annotations

import pytest

from vllm_patch import envs
from vllm_patch.conformance import g2 as g2_scenarios
from vllm_patch.patching import REGISTRY, State, apply_patch, revert_patch, vllm_version
from vllm_patch.v1.core.sched.scheduler import g2_commit_cut as g2

# These test the plugin's G2 code (skipped on a build carrying G2).
pytestmark = [pytest.mark.scheduler, pytest.mark.usefixtures("plugin_g2")]

INLINE_DEPENDENT = ("g2-commit-cut", "g2-spec-stats-cap")


def _names() -> list[str]:
    return [n for n, o in REGISTRY.outcomes.items()
            if n.startswith(INLINE_DEPENDENT) and o.state is State.APPLIED]


def _reapply(names: list[str], inline: bool, monkeypatch) -> list[str]:
    monkeypatch.setattr(g2, "INLINE_AUDITED", inline)
    kinds = []
    for name in names:
        patch = REGISTRY.patches[name]
        revert_patch(name)
        outcome = apply_patch(patch, envs.settings())
        assert outcome.state is State.APPLIED, outcome.detail
        fn = getattr(outcome.owner, outcome.attr)
        kinds.append(fn.__code__.co_qualname.split(".")[0])
    return kinds


@pytest.fixture
def fallback(patched, monkeypatch):
    if not patched:
        pytest.skip("patched-only: which G2 implementation is installed")
    names = _names()
    assert len(names) == 2, names
    kinds = _reapply(names, inline=False, monkeypatch=monkeypatch)
    yield kinds
    _reapply(names, inline=True, monkeypatch=monkeypatch)


def test_audited_versions_take_the_inline_copy(patched):
    if not patched:
        pytest.skip("patched-only")
    if vllm_version() not in ("0.32.0", "0.33.0"):
        pytest.skip("only 0.32.0 / 0.33.0 sources are audited")
    kinds = [getattr(REGISTRY.outcomes[n].owner, REGISTRY.outcomes[n].attr).__code__.co_qualname
             for n in _names()]
    assert all(k.startswith("_inline") for k in kinds), kinds


@pytest.mark.parametrize("scenario", g2_scenarios.SCENARIOS, ids=lambda s: s.name)
def test_wrapping_fallback_keeps_g2(fallback, scenario, check_scenario):
    assert not any(k.startswith("_inline") for k in fallback), fallback
    check_scenario(scenario)
