"""vLLM's own tests with the patches active: a budgeted slice of the vLLM
release's own test suite (from its source distribution on the package index),
run stock and patched through `pytest -p vllm_patch.testing.pytest_plugin`
(`vllm_patch.testing.vllm_suites` does the fetching, the offline model
stand-ins and the runs).

The slice is the part of vLLM's suites that runs the code the guarantees
patch: the scheduler's spec-decoding, stop and structured-output tests, the
structured-output manager's draft/bitmask flow, and the ExampleConnector
(P/D) scheduler tests. It asserts that the tests that pass stock and fail
patched are exactly the documented ones (docs/vllm-test-suites.md), each
failing on the test's own assertion of the stock behaviour a guarantee
changes (never with an exception raised inside vllm_patch), and that no
test of the slice fails in one mode only otherwise.

It runs both modes itself, so it runs in the patched session only (the stock
session skips it: it would run the same two subprocesses again). It skips
only when the release's sdist cannot be fetched from the package index.
"""

from __future__ import annotations

import subprocess
import threading
import urllib.error

import pytest

from vllm_patch.patching import version_series, vllm_version
from vllm_patch.testing import vllm_suites

pytestmark = pytest.mark.scheduler

# (node id or file, optional -k) of vLLM's own tests, the same on both
# releases. A node id without parameters selects every parameter set.
SLICE = (
    "tests/v1/structured_output/test_structured_output_manager.py::test_regex_flow",
    "tests/v1/core/test_scheduler.py::test_stop_via_update_from_output",
    "tests/v1/core/test_scheduler.py::test_check_stop_min_tokens",
    "tests/v1/core/test_scheduler.py::test_schedule_spec_decoding_stats",
    "tests/v1/core/test_scheduler.py::test_spec_decoding_stats_empty_output",
    "tests/v1/core/test_scheduler.py::test_grammar_compile_error_finishes_only_request",
    "tests/v1/core/test_scheduler.py::test_abort_request_when_structured_output_fsm_cannot_advance",
    "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py",
)

# Pass stock, fail patched in the slice, per vLLM series: each asserts stock
# behaviour a guarantee changes (docs/vllm-test-suites.md) and must fail on
# the assertion named here.
def _regex_flow(assertion: str) -> dict[str, str]:
    return {f"tests/v1/structured_output/test_structured_output_manager.py"
            f"::test_regex_flow[{case}-{backend}]": assertion
            for case in ("terminates", "early_eos")
            for backend in ("xgrammar", "guidance", "outlines")}


EXPECTED = {
    "0.32": _regex_flow("assert _row_pattern(bitmask) == expected_row_pattern"),
    "0.33": _regex_flow("assert row_pattern == expected_row_pattern"),
}


def _fetch(version: str):
    try:
        return vllm_suites.unpack_tests(version)
    except (OSError, urllib.error.URLError, RuntimeError) as exc:
        pytest.skip(f"vLLM {version}'s source distribution (its own tests) "
                    f"cannot be fetched from the package index: {exc}")


def test_vllm_own_tests_slice(patched, native, tmp_path):
    if not patched:
        pytest.skip("this test runs vLLM's tests stock and patched itself; "
                    "it runs in the patched session only")
    if native:
        pytest.skip("a patched vLLM build: its own and vLLM's tests run in "
                    "the series tier")
    version = vllm_version().split("+")[0]
    series = version_series(version)
    root = _fetch(version)
    try:
        vllm_suites.suite_deps()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"vLLM's test-only packages cannot be installed from the "
                    f"package index: {exc}")
    hf_home = vllm_suites.standin_hub()

    results: dict[str, dict[str, str]] = {}

    def run(mode: str) -> None:
        args = ["--timeout=120"]
        if mode == "patched":
            args.append("--vllm-patch-invariants=raise")
        env = vllm_suites.run_env(mode, None, hf_home)
        results[mode], _ = vllm_suites.run_pytest(
            root, list(SLICE), mode, tmp_path, env, args, timeout=420,
            label=f"vLLM {version}")

    threads = [threading.Thread(target=run, args=(m,)) for m in ("stock", "patched")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    stock, patched_ = results["stock"], results["patched"]
    # The plugin's session header says which vLLM ran and in which state.
    assert "STOCK vLLM: G1-G4 are NOT enforced" in (tmp_path / "stock.log").read_text()
    header = (tmp_path / "patched.log").read_text()
    assert f"on vLLM {version}: G1 patched, G2 patched, G3 patched" in header
    assert "invariant checker: on (raise)" in header
    log = tmp_path / "patched.log"
    assert stock and set(stock) == set(patched_), (
        f"the slice did not run completely in both modes (see {log})")
    assert sum(o == "passed" for o in stock.values()) >= len(stock) // 2, (
        f"most of the slice should pass stock: {vllm_suites.summary(stock)}")
    diff = vllm_suites.differences(stock, patched_)
    crash = vllm_suites.crashes(tmp_path, "patched")
    inside = {k: c["crash"] for k, c in crash.items() if c["in_vllm_patch"]}
    assert inside == {}, "patched failures raised inside vllm_patch"
    assert diff["regressions"] == [], (
        "pass stock, fail patched, and not a documented stock-behaviour test")
    expected = EXPECTED[series]
    assert sorted(d[0] for d in diff["expected"]) == sorted(expected)
    for nodeid, assertion in expected.items():
        assert crash[nodeid]["source"] == assertion, (nodeid, crash[nodeid])
    assert diff["fixed"] == [] and diff["other"] == []


@pytest.mark.unit
def test_failure_through_a_wrapper_that_stock_raises_too_is_not_ours():
    err = {"crash": "vllm/_custom_ops.py:12: AttributeError: no op", "in_vllm_patch": True}
    stock = {"a": dict(err, in_vllm_patch=False), "b": dict(err, in_vllm_patch=False)}
    patched = {
        "a": err,                                          # vLLM's error, through our wrapper
        "b": dict(err, crash="vllm_patch/x.py:3: KeyError"),  # a different error: ours
        "c": err,                                          # stock passed: ours
        "d": dict(err, in_vllm_patch=False),               # no frame of ours
    }
    assert vllm_suites.raised_in_vllm_patch(stock, patched) == (["b", "c"], ["a"])


@pytest.mark.unit
def test_a_test_pytest_stops_inside_is_recorded_as_an_error_not_a_pass(tmp_path):
    """vLLM's mooncake tests once made pytest raise an INTERNALERROR while it
    formatted a failure: the session stopped inside that test, and the
    outcome file must not call it passed."""
    import json
    import sys

    (tmp_path / "conftest.py").write_text(
        "import pytest\n"
        "@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n"
        "    if item.name == 'test_b' and call.when == 'call':\n"
        "        raise RuntimeError('reporting blew up')\n"
        "    yield\n")
    (tmp_path / "test_x.py").write_text(
        "def test_a():\n    pass\n\ndef test_b():\n    assert 0\n\n"
        "def test_c():\n    pass\n")
    out = tmp_path / "outcomes.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "vllm_patch.testing.pytest_plugin",
         "-p", "no:cacheprovider", f"--vllm-patch-outcomes={out}", "-q", "test_x.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "INTERNALERROR" in proc.stdout + proc.stderr, proc.stdout[-2000:]
    rows = {json.loads(line)["nodeid"]: json.loads(line) for line in out.read_text().splitlines()}
    assert rows["test_x.py::test_a"]["outcome"] == "passed"
    assert rows["test_x.py::test_b"]["outcome"] == "error"
    assert "no report of the test's call" in rows["test_x.py::test_b"]["crash"]
    assert "test_x.py::test_c" not in rows  # never ran
