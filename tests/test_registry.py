"""The package contract (GUARANTEES.md, "The contract of the package"):
idempotent register(), exact revert, version gating, strict mode, the
disable/skip switches, typed env parsing, and where the warnings go.

Test-only patches target harmless attributes of real vLLM classes
(vllm.outputs) in a fresh registry; every test reverts them and checks vLLM
is pristine afterwards. Each test sets the env it needs, so the module is
correct in both the patched and the stock (VLLM_PATCH_DISABLE=1) run.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import vllm
import vllm.outputs as outputs

import vllm_patch
from vllm_patch import envs, patching
from vllm_patch.patching import Patch, PatchError, State

pytestmark = pytest.mark.unit

OWN = outputs.PoolingRequestOutput           # defines __repr__ itself
INHERITS = outputs.EmbeddingRequestOutput    # inherits it from OWN
STATIC = outputs.EmbeddingOutput             # from_base is a staticmethod
ORIGINALS = {
    (OWN, "__repr__"): vars(OWN)["__repr__"],
    (STATIC, "from_base"): vars(STATIC)["from_base"],
}
SERIES = patching.version_series(patching.vllm_version())


def _wrapper(calls: list[str]):
    """make(): counts how often it built a replacement."""
    def make(original):
        calls.append("made")

        def __repr__(self):
            return "patched " + original(self)
        return __repr__
    return make


def make_patch(name="test-own", guarantee="G1", target="vllm.outputs:PoolingRequestOutput.__repr__",
               versions=("0.32", "0.33"), signature=("self",), make=None, **kw) -> Patch:
    return Patch(name=name, guarantee=guarantee, target=target, versions=versions,
                 signature=signature, make=make or _wrapper([]), why="test",
                 how="test", upstream="-", remove_when="-", **kw)


def assert_pristine() -> None:
    for (owner, attr), original in ORIGINALS.items():
        assert vars(owner)[attr] is original, f"{owner.__name__}.{attr} left patched"
    assert "__repr__" not in vars(INHERITS), "EmbeddingRequestOutput.__repr__ left patched"


@pytest.fixture
def registry(monkeypatch):
    """A fresh registry holding only test patches; register() loads no modules."""
    for name in envs.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    fresh = patching.Registry()
    monkeypatch.setattr(patching, "REGISTRY", fresh)
    monkeypatch.setattr(vllm_patch, "PATCH_MODULES", {})
    assert_pristine()
    yield fresh
    patching.revert_all()
    assert_pristine()


@pytest.fixture
def warnings_seen():
    """Records reaching the "vllm_patch" logger (a handler on it directly, as
    vLLM's own tests do for "vllm": independent of propagation)."""
    records: list[logging.LogRecord] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record)

    log = logging.getLogger("vllm_patch")
    handler = Grab(level=logging.WARNING)
    log.addHandler(handler)
    yield records
    log.removeHandler(handler)


def outcome(name: str) -> patching.Outcome:
    return patching.REGISTRY.outcomes[name]


# -- idempotence and revert -------------------------------------------------

def test_register_twice_wraps_once(registry):
    calls: list[str] = []
    registry.add(make_patch(make=_wrapper(calls)))
    vllm_patch.register()
    first = vars(OWN)["__repr__"]
    vllm_patch.register()
    assert vars(OWN)["__repr__"] is first
    assert calls == ["made"]
    assert getattr(first, patching.ORIGINAL_ATTR) is ORIGINALS[(OWN, "__repr__")]
    assert outcome("test-own").state is State.APPLIED


def test_real_patches_not_double_wrapped():
    """The package's own patches, registered by conftest, survive a second
    register() unwrapped-twice (vacuous in the stock run: nothing applied)."""
    vllm_patch.register()
    vllm_patch.register()
    for out in patching.REGISTRY.outcomes.values():
        if out.state is State.APPLIED and not out.patch.per_instance:
            current = getattr(out.owner, out.attr)
            assert getattr(current, patching.NAME_ATTR, None) == out.patch.name
            assert getattr(out.original, patching.NAME_ATTR, None) is None, (
                f"{out.patch.name} wraps a wrapper")
    if envs.settings().disable:
        assert not any(o.state is State.APPLIED
                       for o in patching.REGISTRY.outcomes.values())


def test_revert_restores_own_attribute(registry):
    registry.add(make_patch())
    vllm_patch.register()
    assert vars(OWN)["__repr__"] is not ORIGINALS[(OWN, "__repr__")]
    assert INHERITS.__repr__ is vars(OWN)["__repr__"]  # subclass sees the patch
    patching.revert_all()
    assert vars(OWN)["__repr__"] is ORIGINALS[(OWN, "__repr__")]


def test_revert_restores_inherited_attribute(registry):
    registry.add(make_patch(name="test-inh",
                            target="vllm.outputs:EmbeddingRequestOutput.__repr__"))
    vllm_patch.register()
    assert "__repr__" in vars(INHERITS)
    assert vars(OWN)["__repr__"] is ORIGINALS[(OWN, "__repr__")]
    patching.revert_all()
    assert "__repr__" not in vars(INHERITS)  # inheritance restored, no copy


def test_revert_after_registry_reload_keeps_inheritance(registry, monkeypatch):
    """Applied by an earlier registry (module reload): the new registry finds
    the patch in place and still reverts to inheritance, not an own copy."""
    patch = make_patch(name="test-inh",
                       target="vllm.outputs:EmbeddingRequestOutput.__repr__")
    registry.add(patch)
    vllm_patch.register()
    again = patching.Registry()
    monkeypatch.setattr(patching, "REGISTRY", again)
    again.add(patch)
    vllm_patch.register()
    assert outcome("test-inh").detail == "already applied"
    patching.revert_all()
    assert "__repr__" not in vars(INHERITS)
    monkeypatch.setattr(patching, "REGISTRY", registry)
    registry.outcomes.clear()


def test_staticmethod_patch_idempotent_and_reverted(registry):
    calls: list[str] = []

    def make(original):
        calls.append("made")
        return staticmethod(lambda pooling_output: original.__func__(pooling_output))

    registry.add(make_patch(name="test-static",
                            target="vllm.outputs:EmbeddingOutput.from_base",
                            signature=("pooling_output",), make=make))
    vllm_patch.register()
    vllm_patch.register()
    assert calls == ["made"]
    assert isinstance(vars(STATIC)["from_base"], staticmethod)
    patching.revert_all()
    assert vars(STATIC)["from_base"] is ORIGINALS[(STATIC, "from_base")]


def test_patched_method_is_used(registry):
    registry.add(make_patch(make=lambda original: lambda self: "patched"))
    vllm_patch.register()
    assert OWN.__repr__(object()) == "patched"


# -- version gating, targets, signatures, strict mode ------------------------

def _unknown_version(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.99.0")


def test_unknown_version_applies_nothing_one_warning_each(registry, monkeypatch,
                                                           warnings_seen):
    _unknown_version(monkeypatch)
    registry.add(make_patch())
    registry.add(make_patch(name="test-g3", guarantee="G3",
                            target="vllm.outputs:EmbeddingRequestOutput.__repr__"))
    vllm_patch.register()
    vllm_patch.register()  # a second call (vLLM loads plugins per process) is quiet
    assert_pristine()
    assert outcome("test-own").state is State.UNKNOWN_VERSION
    msgs = [r.getMessage() for r in warnings_seen if "NOT applied" in r.getMessage()]
    assert len(msgs) == 2, msgs
    own = next(m for m in msgs if "test-own" in m)
    assert "G1 (grammar state is current when it is used) is NOT enforced" in own
    assert "0.99.0" in own
    assert any("test-g3" in m and "G3 (" in m for m in msgs)
    rows = {r["guarantee"]: r for r in patching.guarantee_table()}
    assert rows["G1"]["status"] == "not enforced"


def test_unknown_version_strict_raises(registry, monkeypatch):
    _unknown_version(monkeypatch)
    monkeypatch.setenv("VLLM_PATCH_STRICT", "1")
    registry.add(make_patch())
    with pytest.raises(PatchError, match=r"test-own.*unknown vLLM version.*STRICT"):
        vllm_patch.register()
    assert_pristine()


@pytest.mark.parametrize("target, state", [
    ("vllm.outputs:PoolingRequestOutput.no_such_method", State.TARGET_MISSING),
    ("vllm.no_such_module:Thing.method", State.TARGET_MISSING),
    ("vllm.outputs:NoSuchClass.method", State.TARGET_MISSING),
])
def test_missing_target(registry, monkeypatch, warnings_seen, target, state):
    registry.add(make_patch(target=target))
    vllm_patch.register()
    assert outcome("test-own").state is state
    assert any("test-own" in r.getMessage() and "G1" in r.getMessage()
               for r in warnings_seen)
    patching.revert_all()
    registry.outcomes.clear()
    monkeypatch.setenv("VLLM_PATCH_STRICT", "1")
    with pytest.raises(PatchError, match="target not found"):
        vllm_patch.register()


def test_signature_mismatch(registry, monkeypatch, warnings_seen):
    registry.add(make_patch(signature=("self", "extra")))
    vllm_patch.register()
    assert outcome("test-own").state is State.SIGNATURE_MISMATCH
    assert_pristine()
    assert any("signature differs" in r.getMessage() for r in warnings_seen)
    registry.outcomes.clear()
    monkeypatch.setenv("VLLM_PATCH_STRICT", "1")
    with pytest.raises(PatchError, match=r"expected \('self', 'extra'\)"):
        vllm_patch.register()


def test_known_series_not_listed_is_native(registry, warnings_seen):
    other = "0.33" if SERIES == "0.32" else "0.32"
    registry.add(make_patch(versions=(other,)))
    vllm_patch.register()
    assert outcome("test-own").state is State.NOT_APPLICABLE
    assert_pristine()
    assert not warnings_seen
    rows = {r["guarantee"]: r for r in patching.guarantee_table()}
    assert rows["G1"]["status"] == "native"


def test_status_patched_when_applied(registry):
    registry.add(make_patch())
    vllm_patch.register()
    rows = {r["guarantee"]: r for r in patching.guarantee_table()}
    assert rows["G1"]["status"] == "patched"
    assert rows["G1"]["patches"][0]["name"] == "test-own"
    assert rows["G2"]["status"] == "not enforced"


# -- switches -----------------------------------------------------------------

def test_disable_applies_nothing(registry, monkeypatch):
    monkeypatch.setenv("VLLM_PATCH_DISABLE", "1")
    registry.add(make_patch())
    vllm_patch.register()
    assert_pristine()
    assert outcome("test-own").state is State.DISABLED
    assert patching.guarantee_table()[0]["status"] == "not enforced"


def test_disable_keeps_test_only_switches(registry, monkeypatch, warnings_seen):
    """A stock-vs-patched comparison needs stock vLLM in the same set-up (e.g.
    async scheduling forced on the CPU): under VLLM_PATCH_DISABLE=1 a
    test-only switch obeys only its own variable; guarantee patches stay off."""
    monkeypatch.setenv("VLLM_PATCH_DISABLE", "1")
    registry.add(make_patch())
    registry.add(make_patch(name="test-switch", guarantee="test-only",
                            target="vllm.outputs:EmbeddingRequestOutput.__repr__",
                            enabled=lambda s: s.test_force_async_scheduling))
    vllm_patch.register()
    assert outcome("test-switch").state is State.DISABLED
    assert_pristine()
    monkeypatch.setenv("VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING", "1")
    vllm_patch.register()
    assert outcome("test-own").state is State.DISABLED
    assert outcome("test-switch").state is State.APPLIED
    assert "__repr__" in vars(INHERITS)
    assert patching.guarantee_table()[0]["status"] == "not enforced"
    msgs = [r.getMessage() for r in warnings_seen]
    assert any("no patch applied" in m and "TEST ONLY switches still on" in m
               and "test-switch" in m for m in msgs), msgs
    monkeypatch.delenv("VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING")
    vllm_patch.register()
    assert outcome("test-switch").state is State.DISABLED
    assert_pristine()


def test_disable_wins_over_strict(registry, monkeypatch):
    monkeypatch.setenv("VLLM_PATCH_DISABLE", "1")
    monkeypatch.setenv("VLLM_PATCH_STRICT", "1")
    _unknown_version(monkeypatch)
    registry.add(make_patch())
    vllm_patch.register()  # no PatchError: the user asked for stock
    assert_pristine()


def test_skip_by_name(registry, monkeypatch, warnings_seen):
    monkeypatch.setenv("VLLM_PATCH_SKIP", " test-own , nonexistent")
    monkeypatch.setenv("VLLM_PATCH_STRICT", "1")  # a user's skip is not an error
    registry.add(make_patch())
    registry.add(make_patch(name="test-inh",
                            target="vllm.outputs:EmbeddingRequestOutput.__repr__"))
    vllm_patch.register()
    assert outcome("test-own").state is State.SKIPPED_BY_USER
    assert vars(OWN)["__repr__"] is ORIGINALS[(OWN, "__repr__")]
    assert outcome("test-inh").state is State.APPLIED
    msgs = [r.getMessage() for r in warnings_seen]
    assert any("test-own" in m and "VLLM_PATCH_SKIP" in m and "G1" in m for m in msgs)


def test_opt_in_patch_off_by_default(registry, monkeypatch):
    registry.add(make_patch(enabled=lambda s: s.test_force_async_scheduling))
    vllm_patch.register()
    assert outcome("test-own").state is State.OFF
    assert_pristine()
    monkeypatch.setenv("VLLM_PATCH_TEST_FORCE_ASYNC_SCHEDULING", "1")
    vllm_patch.register()
    assert outcome("test-own").state is State.APPLIED


@pytest.mark.parametrize("var", ["VLLM_PATCH_DISABLE", "VLLM_PATCH_STRICT",
                                 "VLLM_PATCH_CHECK_INVARIANTS"])
def test_bad_boolean_is_a_clear_error(registry, monkeypatch, var):
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ValueError, match=rf"{var}='maybe' is not a boolean"):
        vllm_patch.register()


@pytest.mark.parametrize("raw, value", [("1", True), ("TRUE", True), (" on ", True),
                                        ("0", False), ("no", False), ("", False)])
def test_boolean_spellings(monkeypatch, raw, value):
    monkeypatch.setenv("VLLM_PATCH_STRICT", raw)
    assert envs.settings().strict is value


def test_every_env_var_documented():
    src = open(envs.__file__).read()
    used = {w.strip('"') for w in src.split() if w.startswith('"VLLM_PATCH_')}
    used = {u.rstrip('",):') for u in used}
    assert used <= set(envs.ENV_VARS), used - set(envs.ENV_VARS)


# -- records ------------------------------------------------------------------

def test_patch_record_validation(registry):
    with pytest.raises(ValueError, match="guarantee must be one of"):
        make_patch(guarantee="G9")
    with pytest.raises(ValueError, match="module:attr"):
        make_patch(target="vllm.outputs.PoolingRequestOutput.__repr__")
    registry.add(make_patch())
    with pytest.raises(ValueError, match="two patches named"):
        registry.add(make_patch())


def test_version_series():
    assert patching.version_series("0.32.0+cpu") == "0.32"
    assert patching.version_series("0.33.1rc1.dev5+g1234") == "0.33"
    assert patching.version_series("unknown") == "unknown"


# -- logging in a real vLLM process ------------------------------------------

def _child(code: str, **env: str) -> str:
    full = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", **env}
    full.pop("VLLM_PATCH_STRICT", None)
    proc = subprocess.run([sys.executable, "-c", code], env=full, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_log_lines_reach_vllm_log_after_vllm_configured_logging():
    """As in an engine: vLLM configures its logging, then loads plugins through
    the real entry point; our lines come out in vLLM's format, INFO included."""
    out = _child(
        "from vllm.logger import configure_logging\n"
        "from vllm.config.logging import LoggingConfig\n"
        "configure_logging(LoggingConfig())\n"
        "import vllm.plugins; vllm.plugins.load_general_plugins()\n"
        "import logging; logging.getLogger('vllm_patch.x').warning('PROBE-WARN')\n",
        VLLM_PATCH_DISABLE="0")
    assert "vllm_patch 0.1.0 on vLLM" in out  # the INFO line
    warn = next(line for line in out.splitlines() if "PROBE-WARN" in line)
    assert "WARNING" in warn and "pid=" in warn, warn  # vLLM's formatter


def test_log_lines_visible_before_vllm_configured_logging():
    out = _child(
        "import vllm.plugins; vllm.plugins.load_general_plugins()\n",
        VLLM_PATCH_DISABLE="1")
    line = next(line for line in out.splitlines() if "VLLM_PATCH_DISABLE=1" in line)
    assert line.startswith("WARNING"), line


def test_two_patches_on_one_attribute_are_refused():
    """A second patch on an attribute another patch replaces (same vLLM
    series) would be invisible to revert/re-apply: refused at load time."""
    from vllm_patch.patching import Patch, Registry

    def make(original):
        return original

    common = dict(guarantee="G1", signature=("self",), make=make, why="t",
                  how="t", upstream="t", remove_when="t",
                  target="vllm.v1.core.sched.scheduler:Scheduler.schedule")
    reg = Registry()
    reg.add(Patch(name="a", versions=("0.32",), **common))
    reg.add(Patch(name="b", versions=("0.33",), **common))  # other series: fine
    with pytest.raises(ValueError, match="both replace"):
        reg.add(Patch(name="c", versions=("0.33",), **common))


# -- all-or-nothing, error isolation, pins, per-object patches -----------------

def test_failed_patch_withdraws_its_guarantee(registry, warnings_seen):
    """A patch release changed one target's signature: the guarantee's other
    patches do not stay applied, and one line names the failing patch."""
    registry.add(make_patch())  # G1, applies
    registry.add(make_patch(name="test-changed",
                            target="vllm.outputs:EmbeddingRequestOutput.__repr__",
                            signature=("self", "extra")))
    registry.add(make_patch(name="test-g3", guarantee="G3",
                            target="vllm.outputs:EmbeddingOutput.from_base",
                            signature=("pooling_output",),
                            make=lambda original: original))
    vllm_patch.register()
    assert outcome("test-changed").state is State.SIGNATURE_MISMATCH
    assert outcome("test-own").state is State.WITHDRAWN
    assert "test-changed" in outcome("test-own").detail
    assert vars(OWN)["__repr__"] is ORIGINALS[(OWN, "__repr__")]
    assert outcome("test-g3").state is State.APPLIED  # other guarantees stay
    rows = {r["guarantee"]: r for r in patching.guarantee_table()}
    assert rows["G1"]["status"] == "not enforced"
    assert "test-changed" in rows["G1"]["reason"]
    assert rows["G3"]["status"] == "patched"
    g1_lines = [r.getMessage() for r in warnings_seen if "G1 (" in r.getMessage()]
    assert len(g1_lines) == 1 and "signature differs" in g1_lines[0], g1_lines
    vllm_patch.register()  # idempotent: still withdrawn, no second line
    assert outcome("test-own").state is State.WITHDRAWN
    assert len([r for r in warnings_seen if "G1 (" in r.getMessage()]) == 1


def _raising_make(original):
    raise RuntimeError("boom in make")


def test_raising_patch_is_contained(registry, monkeypatch, warnings_seen):
    registry.add(make_patch(make=_raising_make))
    registry.add(make_patch(name="test-inh",
                            target="vllm.outputs:EmbeddingRequestOutput.__repr__"))
    vllm_patch.register()  # vLLM starts: nothing raised
    assert outcome("test-own").state is State.ERROR
    assert outcome("test-own").detail == "RuntimeError: boom in make"
    assert outcome("test-inh").state is State.WITHDRAWN
    assert_pristine()
    row = patching.guarantee_table()[0]
    assert row["status"] == "not enforced" and "boom in make" in row["reason"]
    assert any("boom in make" in r.getMessage() for r in warnings_seen)
    registry.outcomes.clear()
    monkeypatch.setenv("VLLM_PATCH_STRICT", "1")
    with pytest.raises(PatchError, match=r"G1 .*boom in make.*STRICT"):
        vllm_patch.register()
    assert_pristine()


def test_patch_module_import_error_is_contained(registry, monkeypatch, tmp_path):
    (tmp_path / "vllm_patch_test_broken.py").write_text("raise ImportError('gone')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(vllm_patch, "PATCH_MODULES",
                        {"vllm_patch_test_broken": ("G1",)})
    registry.add(make_patch())
    vllm_patch.register()
    assert outcome("test-own").state is State.WITHDRAWN
    assert_pristine()
    row = patching.guarantee_table()[0]
    assert row["status"] == "not enforced"
    assert "vllm_patch_test_broken failed to import (ImportError: gone)" in row["reason"]
    monkeypatch.setenv("VLLM_PATCH_STRICT", "1")
    with pytest.raises(PatchError, match="vllm_patch_test_broken"):
        vllm_patch.register()


def test_optional_patch_failure_keeps_guarantee(registry):
    registry.add(make_patch())
    registry.add(make_patch(name="test-optional", required=False,
                            target="vllm.outputs:EmbeddingRequestOutput.__repr__",
                            signature=("self", "extra")))
    vllm_patch.register()
    assert outcome("test-own").state is State.APPLIED
    assert outcome("test-optional").state is State.SIGNATURE_MISMATCH
    assert patching.guarantee_table()[0]["status"] == "patched"


def test_user_skip_is_partial_not_withdrawn(registry, monkeypatch):
    monkeypatch.setenv("VLLM_PATCH_SKIP", "test-own")
    registry.add(make_patch())
    registry.add(make_patch(name="test-inh",
                            target="vllm.outputs:EmbeddingRequestOutput.__repr__"))
    vllm_patch.register()
    assert outcome("test-inh").state is State.APPLIED
    row = patching.guarantee_table()[0]
    assert row["status"] == "partial" and "test-own" in row["reason"]


def _pin(digest: str, fallback: bool = False) -> patching.Pin:
    return patching.Pin(target="vllm.outputs:PoolingRequestOutput.__init__",
                        digests={SERIES: digest}, relies_on="test",
                        fallback=fallback)


def test_pin_drift_blocks_the_patch(registry):
    real = patching.source_digest(vars(OWN)["__init__"])
    registry.add(make_patch(pins=(_pin(real),)))
    vllm_patch.register()
    assert outcome("test-own").state is State.APPLIED
    patching.revert_all()
    registry.patches.clear()
    registry.add(make_patch(pins=(_pin("0" * 16),)))
    vllm_patch.register()
    assert outcome("test-own").state is State.SOURCE_DRIFT
    assert "PoolingRequestOutput.__init__" in outcome("test-own").detail
    assert_pristine()
    assert patching.guarantee_table()[0]["status"] == "not enforced"


def test_pin_drift_with_fallback_applies_and_says_so(registry):
    registry.add(make_patch(pins=(_pin("0" * 16, fallback=True),)))
    vllm_patch.register()
    assert outcome("test-own").state is State.APPLIED
    row = patching.guarantee_table()[0]["patches"][0]
    assert "PoolingRequestOutput.__init__" in row["source_drift"]
    assert row["defined_in"] == __name__


def test_per_object_patch_listed_and_reverted(registry):
    def make(original, tag):
        assert original.__self__ is obj  # the object's own bound attribute
        return lambda: f"{tag}:wrapped"

    registry.add(make_patch(name="test-object", per_instance=True,
                            target="vllm.outputs:PoolingRequestOutput.__repr__",
                            make=make))
    obj = OWN.__new__(OWN)
    assert patching.wrap_instance("test-object", obj, "x") is False  # not armed
    vllm_patch.register()
    assert_pristine()  # the class is untouched
    assert patching.wrap_instance("test-object", obj, "x") is True
    assert patching.wrap_instance("test-object", obj, "y") is True  # idempotent
    assert obj.__dict__["__repr__"]() == "x:wrapped"
    row = patching.guarantee_table()[0]["patches"][0]
    assert row["objects"] == 1 and row["implementation"] == "per-object wrapper"
    patching.revert_all()
    assert "__repr__" not in obj.__dict__


def test_undo_runs_on_revert(registry):
    undone: list[bool] = []
    registry.add(make_patch(undo=lambda: undone.append(True)))
    vllm_patch.register()
    patching.revert_all()
    assert undone == [True]


def test_unknown_version_one_line_per_guarantee(registry, monkeypatch, warnings_seen):
    _unknown_version(monkeypatch)
    for i in range(3):
        registry.add(make_patch(name=f"test-{i}", target=(
            "vllm.outputs:PoolingRequestOutput.__repr__" if i == 0 else
            "vllm.outputs:EmbeddingRequestOutput.__repr__"),
            versions=("0.32",) if i == 1 else ("0.33",) if i == 2 else ("0.32", "0.33")))
    vllm_patch.register()
    lines = [r.getMessage() for r in warnings_seen]
    assert len(lines) == 1, lines
    assert "test-0, test-1, test-2 NOT applied" in lines[0]


def test_status_reflects_stop_switch(registry, monkeypatch):
    monkeypatch.setenv("VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION", "0")
    registry.add(make_patch(name="test-g2", guarantee="G2"))
    vllm_patch.register()
    row = {r["guarantee"]: r for r in patching.guarantee_table()}["G2"]
    assert row["status"] == "partial"
    assert "VLLM_PATCH_STOP_ON_GRAMMAR_TERMINATION=0" in row["reason"]


def test_unknown_version_package_patches_one_line(registry, monkeypatch, warnings_seen):
    _unknown_version(monkeypatch)
    registry.add(make_patch(name="test-pkg-a", guarantee="package"))
    registry.add(make_patch(name="test-pkg-b", guarantee="package",
                            target="vllm.outputs:EmbeddingRequestOutput.__repr__"))
    vllm_patch.register()
    lines = [r.getMessage() for r in warnings_seen]
    assert len(lines) == 1 and "test-pkg-a, test-pkg-b NOT applied" in lines[0], lines


def test_optional_patch_fallback_shown(registry):
    registry.add(make_patch())
    registry.add(make_patch(name="test-optional", required=False,
                            without="the slow path runs",
                            target="vllm.outputs:EmbeddingRequestOutput.__repr__",
                            signature=("self", "extra")))
    vllm_patch.register()
    row = patching.guarantee_table()[0]
    assert row["implementation"] == "the slow path runs (test-optional is not applied)"
