"""Drift pins: the vLLM source the patches mirror or rely on is the audited one.

Every `Pin` of every patch module must match the installed vLLM's source for
its series: this is the test that fails when someone bumps vLLM (then run
`scripts/audit_vllm.py X.Y.Z` for the diffs, check what each pin relies on,
fix the patch, and update `vllm_patch/audited.py`). The audit script's core
(`audit`) reports "all match" on the installed vLLM and reports a pin whose
digest or source differs, with the diff. Runs on 0.32 and on 0.33
(PYTHONPATH=<0.33 tree>), patched or stock (nothing here depends on it but
the registry check, which is patched-only).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

import vllm_patch
from vllm_patch import audited, patching
from vllm_patch.patching import NAME_ATTR, ORIGINAL_ATTR, State

pytestmark = pytest.mark.unit

SERIES = patching.version_series(patching.vllm_version())
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "audit_vllm.py"


def _records() -> list:
    out = []
    for name in vllm_patch.PATCH_MODULES:
        out.extend(getattr(importlib.import_module(name), "PATCHES", []))
    return out


def _stock(obj):
    """vLLM's own object behind any vllm_patch replacement (conftest
    registers the patches before the tests run)."""
    for _ in range(8):
        holder = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
        if getattr(holder, NAME_ATTR, None) is None:
            return obj
        obj = getattr(holder, ORIGINAL_ATTR)
    return obj


def _pins(series: str) -> list[tuple]:
    return [(patch, pin) for patch in _records() if series in patch.versions
            for pin in patch.pins]


def _id(pair) -> str:
    patch, pin = pair
    return f"{patch.name}:{pin.target.split(':', 1)[1]}"


@pytest.mark.parametrize("pair", _pins(SERIES), ids=_id)
def test_pin_matches_the_installed_vllm(pair):
    patch, pin = pair
    assert SERIES in pin.digests, (
        f"{patch.name} applies on vLLM {SERIES} but its pin on {pin.target} "
        f"has no digest for it (nothing would be checked)")
    found = patching.source_digest(_stock(patching.resolve_target(pin.target)))
    assert found == pin.digests[SERIES], (
        f"vLLM {patching.vllm_version()} changed {pin.target}, which "
        f"{patch.name} relies on: {pin.relies_on}. Run scripts/audit_vllm.py "
        f"for the diff, check the patch against it, then update "
        f"vllm_patch/audited.py")


def test_every_series_of_a_patch_is_pinned():
    """A pin without a digest for a series its patch applies on would check
    nothing there; every table entry is used by some pin."""
    used = set()
    for patch in _records():
        for pin in patch.pins:
            used.add(pin.target)
            assert pin.digests == {s: d for s, d in audited.DIGESTS[pin.target].items()
                                   if s in pin.digests}, (patch.name, pin.target)
            missing = set(patch.versions) - set(pin.digests)
            assert not missing, (patch.name, pin.target, missing)
    assert used == set(audited.DIGESTS), set(audited.DIGESTS) - used


def test_registry_sees_no_drift(patched):
    """On the audited release nothing is refused or in fallback for a pin,
    and the G2 replacements are the inline copies."""
    if not patched:
        pytest.skip("patched-only: registry outcomes")
    for name, outcome in patching.REGISTRY.outcomes.items():
        assert outcome.state is not State.SOURCE_DRIFT, (name, outcome.detail)
        assert not outcome.drift, (name, outcome.drift)
    impl = {n: o.impl for n, o in patching.REGISTRY.outcomes.items()
            if n.startswith(("g2-commit-cut", "g2-spec-stats-cap"))
            and o.state is State.APPLIED}
    assert impl and set(impl.values()) == {"inline"}, impl


# ------------------------------------------- G2: one source of truth (pin)
def test_g2_inline_choice_reads_the_pin(monkeypatch):
    """The G2 make() picks the inline copy exactly when the stock source has
    its pin's digest, and tags the replacement with IMPL_ATTR."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_patch.v1.core.sched.scheduler import g2_commit_cut as g2

    update = _stock(vars(Scheduler)["_update_request_with_output"])
    stats = _stock(vars(Scheduler)["make_spec_decoding_stats"])
    make = g2._make_update(SERIES)
    assert getattr(make(update), patching.IMPL_ATTR) == "inline"
    assert getattr(g2._make_spec_stats_patch(stats), patching.IMPL_ATTR) == "inline"
    for attr in ("_UPDATE_PIN", "_SPEC_STATS_PIN"):
        pin = getattr(g2, attr)
        monkeypatch.setattr(g2, attr, dataclasses.replace(
            pin, digests={s: "0" * 16 for s in pin.digests}))
    assert getattr(make(update), patching.IMPL_ATTR) == "wrapper"
    assert getattr(g2._make_spec_stats_patch(stats), patching.IMPL_ATTR) == "wrapper"
    monkeypatch.undo()  # the real pins again; the test switch still wins
    monkeypatch.setattr(g2, "INLINE_AUDITED", False)
    assert getattr(make(update), patching.IMPL_ATTR) == "wrapper"


# ------------------------------------------------------- the audit script
@pytest.fixture(scope="module")
def audit_vllm():
    spec = importlib.util.spec_from_file_location("audit_vllm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["audit_vllm"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("audit_vllm", None)


@pytest.fixture(scope="module")
def facts(audit_vllm):
    """Probed in this process (the child process of the script imports the
    same vLLM; its own run is `python scripts/audit_vllm.py`)."""
    return audit_vllm.probe(audit_vllm.targets_for(audit_vllm.load_records(), SERIES))


def _audited_release(facts) -> dict | None:
    dist, version = audited.AUDITED_RELEASES[SERIES]
    return facts if facts["version"].split("+")[0] == version else None


def test_audit_all_match_on_the_installed_vllm(audit_vllm, facts):
    report = audit_vllm.audit(audit_vllm.load_records(), facts, SERIES,
                              audited_facts=_audited_release(facts))
    text = audit_vllm.render(report)
    assert report.ok, text
    assert report.summary().endswith("all match"), report.summary()
    assert "0 changed" in report.summary() and report.changed_pins == []
    assert {r.name for r in report.patches} == {
        p.name for p in _records() if SERIES in p.versions}


def test_audit_reports_an_altered_pin(audit_vllm, facts, monkeypatch):
    """A pin whose recorded digest is not the source's is reported (and,
    against the audited release, as a record that is not its source)."""
    from vllm_patch.v1.core.sched.scheduler import g1_inflight

    target = "vllm.v1.core.sched.scheduler:Scheduler.schedule"
    altered = []
    for patch in g1_inflight.PATCHES:
        pins = tuple(dataclasses.replace(p, digests={**p.digests, SERIES: "0" * 16})
                     if p.target == target else p for p in patch.pins)
        altered.append(dataclasses.replace(patch, pins=pins))
    monkeypatch.setattr(g1_inflight, "PATCHES", altered)
    report = audit_vllm.audit(audit_vllm.load_records(), facts, SERIES,
                              audited_facts=_audited_release(facts))
    assert not report.ok
    assert {p.target for p in report.changed_pins} == {target}
    bad = [r.name for r in report.patches if any(not p.matches for p in r.pins)]
    assert bad == ["g1-gate-schedule"]
    text = audit_vllm.render(report)
    assert f"pin {target} CHANGED" in text and "the patch is not applied" in text
    assert ", 1 changed" in report.summary(), report.summary()


def test_audit_shows_the_diff_of_a_changed_source(audit_vllm, facts):
    """A release whose pinned source differs: the report names the patches
    relying on it, says which fall back, and shows the unified diff from the
    audited source."""
    target = "vllm.v1.core.sched.scheduler:Scheduler._update_request_with_output"
    new = copy.deepcopy(facts)
    fact = new["targets"][target]
    fact["source"] = fact["source"].replace(
        "stopped = False", "stopped = False  # changed upstream", 1)
    fact["digest"] = "f" * 16
    report = audit_vllm.audit(audit_vllm.load_records(), new, SERIES,
                              audited_facts=facts)
    assert not report.ok and {p.target for p in report.changed_pins} == {target}
    # The G2 commit cut has a fallback for this pin: it applies as a wrapper.
    assert all(p.fallback for p in report.changed_pins)
    diff = report.diffs[target]
    assert "-        stopped = False\n" in diff
    assert "+        stopped = False  # changed upstream\n" in diff
    assert "the patch runs its fallback" in audit_vllm.render(report)


def test_audit_reports_a_missing_target_and_signature(audit_vllm, facts):
    new = copy.deepcopy(facts)
    t_missing = "vllm.v1.core.sched.scheduler:Scheduler.schedule"
    t_sig = "vllm.v1.core.sched.scheduler:Scheduler._free_request"
    new["targets"][t_missing] = {"exists": False, "error": "gone"}
    new["targets"][t_sig]["params"] = ["self", "request"]
    report = audit_vllm.audit(audit_vllm.load_records(), new, SERIES)
    by_name = {r.name: r for r in report.patches}
    assert by_name["g1-gate-schedule"].missing
    assert by_name["g1-free"].signature
    assert not report.ok


def test_nearest_series(audit_vllm):
    known = ("0.32", "0.33")
    assert audit_vllm.nearest_series("0.31", known) == "0.32"
    assert audit_vllm.nearest_series("0.34", known) == "0.33"


def test_patches_applied_on_the_series_build_accept_its_digests():
    """On a vLLM build made from the patch series the plugin still applies
    every patch the series does not replace (nor a guarantee it carries
    whole): a pin of such a patch on a function the series changes
    (audited.BUILD_DIGESTS) must accept the build's source, or the patch,
    and with it its guarantee, would not apply there."""
    from vllm_patch import series

    for version in ("0.32.0", "0.33.0"):
        s = ".".join(version.split(".")[:2])
        patches = series.read_series(version)
        replaced = {pid for sp in patches for pid in sp.replaces}
        carried = {g for sp in patches for g in sp.guarantees}
        for patch in _records():
            if s not in patch.versions or patch.name in replaced \
                    or patch.guarantee in carried:
                continue
            for p in patch.pins:
                if p.target in audited.BUILD_DIGESTS and s in p.digests:
                    assert p.build_digests.get(s) == \
                        audited.BUILD_DIGESTS[p.target][s], (patch.name, p.target)
