"""pytest plugin: run any test suite (vLLM's own included) with the patches on.

    pytest -p vllm_patch.testing.pytest_plugin tests/v1/core
    PYTEST_ADDOPTS="-p vllm_patch.testing.pytest_plugin" pytest ...   # same
    pytest -p vllm_patch.testing.pytest_plugin --vllm-patch-invariants=raise ...
    VLLM_PATCH_DISABLE=1 pytest -p vllm_patch.testing.pytest_plugin ...  # stock

It applies the patches once for the session (`vllm_patch.register()`, before
any test module is imported, so every scheduler the tests build is the
patched one; vLLM's own plugin loader calling it again later is a no-op) and
prints in the session header which guarantees are enforced on this build, or
that none is (VLLM_PATCH_DISABLE=1, stock vLLM).

`--vllm-patch-invariants` switches on the runtime invariant checker for the
session: `log` (a violation is logged and counted) or `raise` (a violation
raises `InvariantViolation` in the test that caused it). It sets the
VLLM_PATCH_CHECK_INVARIANTS / VLLM_PATCH_INVARIANTS_RAISE variables, so
engine-core processes started by the tests inherit it. Without the option
those variables are left as they are.

It is deliberately not a `pytest11` entry point: loading it is always an
explicit choice (`-p`), so installing vllm-patch never changes anyone's test
runs.
"""

from __future__ import annotations

import os

import pytest

_INVARIANT_MODES = ("off", "log", "raise")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vllm-patch", "vllm-patch guarantees")
    group.addoption(
        "--vllm-patch-invariants",
        choices=_INVARIANT_MODES,
        default=None,
        help="runtime invariant checker for the session: off, log (log and "
             "count violations) or raise (a violation fails the test); "
             "default: as VLLM_PATCH_CHECK_INVARIANTS / "
             "VLLM_PATCH_INVARIANTS_RAISE say (off when unset)",
    )
    group.addoption(
        "--vllm-patch-outcomes",
        default=None,
        metavar="FILE",
        help="append one JSON line per test (nodeid, outcome: passed, "
             "failed, error, skipped, xfailed, xpassed) and per collection "
             "error to FILE as the session goes (for stock/patched diffs)",
    )


def _set_invariant_env(mode: str | None) -> None:
    if mode is None:
        return
    os.environ["VLLM_PATCH_CHECK_INVARIANTS"] = "0" if mode == "off" else "1"
    os.environ["VLLM_PATCH_INVARIANTS_RAISE"] = "1" if mode == "raise" else "0"


def header_lines() -> list[str]:
    """What the session runs with: each guarantee's status on this build."""
    import vllm_patch
    from vllm_patch import envs, patching

    settings = envs.settings()
    head = f"vllm-patch {vllm_patch.__version__} on vLLM {patching.vllm_version()}: "
    if settings.disable:
        applied = [o.patch.name for o in patching.REGISTRY.outcomes.values()
                   if o.state is patching.State.APPLIED]
        line = head + ("VLLM_PATCH_DISABLE=1, STOCK vLLM: G1-G4 are NOT "
                       "enforced, no patch applied")
        if applied:
            line += " (test-only switches on: " + ", ".join(applied) + ")"
        return [line]
    rows = patching.guarantee_table(settings)
    lines = [head + ", ".join(f"{r['guarantee']} {r['status']}" for r in rows)]
    for r in rows:
        if r["reason"]:
            lines.append(f"  {r['guarantee']} {r['status']}: {r['reason']}")
    if settings.check_invariants:
        mode = "raise" if settings.invariants_raise else "log"
        lines.append(f"  invariant checker: on ({mode})")
    else:
        lines.append("  invariant checker: off")
    for module, (_, err) in patching.REGISTRY.module_errors.items():
        lines.append(f"  patch module {module} failed to import: {err}")
    return lines


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Before the suite's conftest files are imported (vLLM's import vllm).
    ns = early_config.known_args_namespace
    _set_invariant_env(getattr(ns, "vllm_patch_invariants", None))
    import vllm_patch

    vllm_patch.register()


def pytest_configure(config: pytest.Config) -> None:
    # Also when the plugin is registered too late for the hook above
    # (e.g. `pytest_plugins` in a conftest); register() is idempotent.
    _set_invariant_env(config.getoption("--vllm-patch-invariants"))
    import vllm_patch

    vllm_patch.register()


def pytest_report_header(config: pytest.Config) -> list[str]:
    return header_lines()


class _Outcomes:
    """Per-test outcome of every phase, written when the test is done."""

    def __init__(self, path: str) -> None:
        self.fh = open(path, "a", buffering=1)  # noqa: SIM115 - session-long
        self.pending: dict[str, str] = {}

        self.crash: dict[str, dict] = {}
        # Tests whose outcome was reported (call, or a skip/failure earlier).
        self.reported: set[str] = set()

    def write(self, nodeid: str, outcome: str) -> None:
        import json

        row = {"nodeid": nodeid, "outcome": outcome, **self.crash.pop(nodeid, {})}
        self.fh.write(json.dumps(row) + "\n")

    def _note_crash(self, report) -> None:
        # Where the failure was raised, and whether any frame of its
        # traceback is inside vllm_patch (a crash in our code, as opposed to
        # a test's assertion about behaviour a guarantee changes).
        if report.nodeid in self.crash:
            return
        crash = getattr(report.longrepr, "reprcrash", None)
        text = str(report.longrepr)
        source = ""
        entries = getattr(getattr(report.longrepr, "reprtraceback", None),
                          "reprentries", None) or []
        for entry in entries[-1:]:
            marked = [ln for ln in getattr(entry, "lines", []) if ln.startswith(">")]
            source = marked[-1][1:].strip() if marked else ""
        self.crash[report.nodeid] = {
            "source": source,
            "crash": (f"{crash.path}:{crash.lineno}: {crash.message}"[:400]
                      if crash is not None else text[-400:]),
            "in_vllm_patch": f"{os.sep}vllm_patch{os.sep}" in text,
        }

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self._note_crash(report)
        outcome = self.pending.get(report.nodeid, "passed")
        if report.failed:
            if report.when == "call":
                outcome = "xpassed" if hasattr(report, "wasxfail") else "failed"
            elif outcome != "failed":
                outcome = "error"
        elif report.skipped and outcome == "passed":
            outcome = "xfailed" if hasattr(report, "wasxfail") else "skipped"
        elif report.passed and report.when == "call" and hasattr(report, "wasxfail"):
            outcome = "xpassed"
        self.pending[report.nodeid] = outcome
        if report.when == "call" or report.skipped or report.failed:
            self.reported.add(report.nodeid)
        if report.when == "teardown":
            self.write(report.nodeid, self.pending.pop(report.nodeid))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.write(report.nodeid, "error")

    def pytest_sessionfinish(self) -> None:
        for nodeid, outcome in self.pending.items():  # teardown never ran
            if nodeid not in self.reported:
                # Set up, then no report of its call: pytest stopped inside
                # the test (an INTERNALERROR while reporting it, or the
                # session was interrupted). Not a pass.
                outcome = "error"
                self.crash.setdefault(nodeid, {
                    "source": "", "in_vllm_patch": False,
                    "crash": "no report of the test's call: the pytest "
                             "session stopped inside it (INTERNALERROR or "
                             "interrupted)"})
            self.write(nodeid, outcome)
        self.pending.clear()
        self.fh.close()


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    path = session.config.getoption("--vllm-patch-outcomes")
    if path and not session.config.pluginmanager.has_plugin("vllm-patch-outcomes"):
        session.config.pluginmanager.register(_Outcomes(path), "vllm-patch-outcomes")
