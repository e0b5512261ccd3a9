"""A patched vLLM build that carries a guarantee whole (its patch series'
record lists it in GUARANTEES, with the model runners it holds for): the
plugin applies none of that guarantee's patches, also ones the series does
not name and also under VLLM_PATCH_DISABLE=1 (the build's code holds it
whatever the plugin's switches), and status reads it per model runner.

The build's records are what `vllm_patch.series.native_guarantees` reads
from the installed vLLM; here they are given directly (the released vLLM
of this run has none). The series tier checks the same on a real patched
build (tests/series)."""

from __future__ import annotations

import pytest

from vllm_patch import envs, patching
from vllm_patch.patching import REGISTRY, Outcome, State

pytestmark = pytest.mark.unit

NATIVE = State.NATIVE.value


def _carried(monkeypatch, runners=("V1", "V2"), replaces=()):
    monkeypatch.setattr(patching, "_NATIVE", [{pid: "g2_commit_cut"
                                               for pid in replaces}])
    monkeypatch.setattr(patching, "_NATIVE_GUARANTEES", [{"G2": {
        "series_patch": "g2_commit_cut", "runners": tuple(runners),
        "replaces": tuple(replaces)}}])


def _g2_patches():
    series = patching.version_series(patching.vllm_version())
    mine = [p for p in REGISTRY.patches.values()
            if p.guarantee == "G2" and series in p.versions]
    other = [p for p in REGISTRY.patches.values()
             if p.guarantee == "G2" and series not in p.versions]
    assert mine
    return mine, other


def test_every_patch_of_a_carried_guarantee_is_native(monkeypatch):
    mine, other = _g2_patches()
    named = mine[0].name
    _carried(monkeypatch, replaces=[named])
    for patch in mine:
        outcome = patching._native_outcome(patch)
        assert outcome is not None and outcome.state is State.NATIVE
        if patch.name == named:
            assert outcome.detail == "g2_commit_cut"
        else:
            assert "not named by the build's series" in outcome.detail
    # A patch written for the other vLLM series stays "not needed".
    assert all(patching._native_outcome(p) is None for p in other)
    # Other guarantees are not touched.
    g1 = next(p for p in REGISTRY.patches.values() if p.guarantee == "G1")
    assert patching._native_outcome(g1) is None


def test_carried_guarantee_is_native_under_disable(monkeypatch):
    mine, _ = _g2_patches()
    _carried(monkeypatch)
    monkeypatch.setenv("VLLM_PATCH_DISABLE", "1")
    monkeypatch.setitem(REGISTRY.outcomes, mine[0].name, Outcome(mine[0], State.DISABLED))
    outcome = patching._check(mine[0], envs.settings())
    assert isinstance(outcome, Outcome) and outcome.state is State.NATIVE


def _table(monkeypatch):
    mine, _ = _g2_patches()
    for patch in mine:
        monkeypatch.setitem(REGISTRY.outcomes, patch.name,
                            patching._native_outcome(patch))
    return {r["guarantee"]: r for r in patching.guarantee_table(envs.settings())}


def test_status_native_on_both_runners_and_the_switch_ignored(monkeypatch):
    _carried(monkeypatch)
    monkeypatch.setenv("VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION", "0")
    row = _table(monkeypatch)["G2"]
    assert row["status"] == NATIVE
    assert "VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION=0 has no effect" in row["reason"]
    assert "the build's series does not name them" in row["reason"]
    assert {r["status"] for r in row["runners"].values()} == {NATIVE}


def test_status_per_runner_when_the_build_carries_one_runner(monkeypatch):
    _carried(monkeypatch, runners=("V1",))
    row = _table(monkeypatch)["G2"]
    assert row["runners"]["V1"]["status"] == NATIVE
    assert row["runners"]["V2"]["status"] == "not enforced"
    assert "for V1 only" in row["runners"]["V2"]["reason"]


def test_grammar_end_on_a_build_that_carries_g2(monkeypatch):
    """G3's draft skip for requests ending in this step asks whether G2
    finishes requests at the grammar's end: on a G2 build it does, although
    no plugin G2 patch is applied there, and also with the plugin's
    stop-on-termination switch off (the build ignores it)."""
    from vllm_patch.v1.spec_decode.grammar_end import g2_finishes_at_grammar_end

    monkeypatch.setattr(REGISTRY, "outcomes", {})
    monkeypatch.setattr(patching, "_NATIVE_GUARANTEES", [{}])
    assert not g2_finishes_at_grammar_end()
    _carried(monkeypatch)
    assert g2_finishes_at_grammar_end()
    monkeypatch.setenv("VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION", "0")
    assert g2_finishes_at_grammar_end()


@pytest.mark.parametrize(("gid", "record"), [("G1", "g1_grammar_state_current"),
                                           ("G3", "g3_runner")])
def test_v1_only_guarantees_from_the_series_records(monkeypatch, gid, record):
    """The records of this repository's series for the running vLLM (as a
    build from it installs them): 0005 names G3's rows, 0006 G3's V1 runner
    side and the guarantee with RUNNERS ("V1",); 0012 G1's scheduler
    patches and the guarantee with RUNNERS ("V1",). Every plugin patch of
    the guarantee is native there (also Model Runner V2's, which the series
    does not name), and status reads it native on V1 and not enforced on
    V2."""
    from vllm_patch import series

    version = {"0.32": "0.32.0", "0.33": "0.33.0"}[
        patching.version_series(patching.vllm_version())]
    native, whole = {}, {}
    for sp in series.read_series(version):
        values = dict(sp.marker)
        for pid in values.get("REPLACES", ()):
            native[pid] = values["SERIES_PATCH"]
        for carried in values.get("GUARANTEES", ()):
            whole[carried] = {"series_patch": values["SERIES_PATCH"],
                          "runners": tuple(values.get("RUNNERS", ())),
                          "replaces": tuple(values.get("REPLACES", ()))}
    assert whole[gid]["runners"] == ("V1",)
    monkeypatch.setattr(patching, "_NATIVE", [native])
    monkeypatch.setattr(patching, "_NATIVE_GUARANTEES", [whole])
    series_id = patching.version_series(patching.vllm_version())
    mine = [p for p in REGISTRY.patches.values()
            if p.guarantee == gid and series_id in p.versions]
    assert {p.name for p in mine} > set(whole[gid]["replaces"])
    for patch in mine:
        outcome = patching._native_outcome(patch)
        assert outcome is not None and outcome.state is State.NATIVE, patch.name
        monkeypatch.setitem(REGISTRY.outcomes, patch.name, outcome)
    row = {r["guarantee"]: r for r in
           patching.guarantee_table(envs.settings())}[gid]
    assert row["status"] == NATIVE
    assert row["runners"]["V1"]["status"] == NATIVE
    assert row["runners"]["V2"]["status"] == "not enforced"
    assert row["runners"]["V2"]["reason"] == (
        f"this vLLM build carries {gid} for V1 only ({record})")
