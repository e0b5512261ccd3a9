"""`vllm-patch status` and `vllm-patch verify`.

`status` runs as a user runs it (the installed console script, a fresh
process per configuration). `verify` runs in this process (its argument
parsing, report and exit codes) and starts its real child processes, stock
and patched, as it does for a user; the console script itself is covered by
the status tests. Every child imports vLLM, so these are the unit tier's
slowest tests: each verify test runs once per vLLM version, in the patched
run of the suite (verify sets VLLM_PATCH_DISABLE for its children itself, so
the stock run of the suite would repeat the very same runs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_patch import conformance, envs, patching
from vllm_patch.testing import series_env

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "conformance_fixtures"
VLLM_033 = series_env.release_033_tree()
IDS = ["G1", "G2", "G3", "G4"]


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600,
        ) -> subprocess.CompletedProcess:
    # The installed console script, from the environment running the tests
    # (its bin folder need not be on PATH: scripts/test.sh uses the venv's
    # python directly).
    exe = (shutil.which("vllm-patch", path=os.path.dirname(sys.executable))
           or shutil.which("vllm-patch"))
    assert exe, "the vllm-patch console script is not installed"
    full = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", **(env or {})}
    return subprocess.run([exe, *args], env=full, text=True, capture_output=True,
                          timeout=timeout)


# -- status -------------------------------------------------------------------

def _check_status(env: dict[str, str] | None, series: str) -> None:
    text = cli("status", env=env)
    assert text.returncode == 0, text.stderr[-3000:]
    lines = text.stdout.splitlines()
    assert f"on vLLM {series}" in lines[0]
    for gid in IDS:
        assert any(line.startswith(gid + " ") for line in lines), (gid, text.stdout)
    data = json.loads(cli("status", "--json", env=env).stdout)
    assert [row["guarantee"] for row in data["guarantees"]] == IDS
    assert patching.version_series(data["vllm"]) == series
    assert data["disabled"] == envs.settings().disable
    for row in data["guarantees"]:
        assert row["status"] in ("native", "patched", "partial", "not enforced")
        if data["disabled"]:
            assert row["status"] != "patched"


def test_status_installed_vllm():  # also the stock run: status reads disabled
    import vllm

    _check_status(None, patching.version_series(vllm.__version__))


def _installed_series() -> str:
    import vllm

    return patching.version_series(vllm.__version__)


@pytest.mark.skipif(not VLLM_033.is_dir(), reason=f"{VLLM_033} not unpacked")
@pytest.mark.skipif(_installed_series() == "0.33",
                    reason="vLLM 0.33 is the installed vLLM of this run: "
                           "test_status_installed_vllm covers it")
def test_status_vllm_033():
    _check_status({"PYTHONPATH": str(VLLM_033)}, "0.33")


def test_status_disabled():
    data = json.loads(cli("status", "--json", env={"VLLM_PATCH_DISABLE": "1"}).stdout)
    assert data["disabled"] is True
    assert all(row["status"] != "patched" for row in data["guarantees"])


def test_status_bad_boolean_fails_clearly(monkeypatch):
    from vllm_patch import cli as cli_module

    monkeypatch.setenv("VLLM_PATCH_DISABLE", "maybe")
    with pytest.raises(ValueError, match="VLLM_PATCH_DISABLE='maybe' is not a boolean"):
        cli_module.main(["status"])


# -- verify ---------------------------------------------------------------------

once_per_version = pytest.mark.skipif(
    envs.settings().disable,
    reason="verify sets VLLM_PATCH_DISABLE for its own children: the patched "
           "run of the suite runs these")


def run_verify(*args: str, capfd, monkeypatch) -> subprocess.CompletedProcess:
    """`vllm-patch verify ARGS` in this process (its children are real)."""
    from vllm_patch import cli as cli_module

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(FIXTURES), os.environ.get("PYTHONPATH")) if p))
    capfd.readouterr()
    code = cli_module.main(["verify", *args])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["vllm-patch", "verify", *args], code, out, err)


@pytest.fixture
def verify(capfd, monkeypatch):
    def run(*args: str) -> subprocess.CompletedProcess:
        return run_verify("--module", "fake_scenarios", *args, capfd=capfd,
                          monkeypatch=monkeypatch)
    return run


@once_per_version
def test_verify_pass_table_and_progress(verify):
    res = verify("-k", "fake_holds", "-k", "fake_fixed_by_patch", "-k", "fake_control",
                 "-k", "fake_future_only")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    out = res.stdout
    row = next(line for line in out.splitlines() if line.startswith("fake_fixed_by_patch"))
    assert row.split()[1:4] == ["G2", "violated", "holds"]
    assert "stock: fake violation seen on stock" in row
    assert "stock already holds here (upstream fix?)" in out  # fake_holds
    control = out.split("fake_control", 1)[1].split("\n", 2)
    assert "upstream fix" not in control[1]  # a control holding on stock is expected
    assert "not applicable" in out  # fake_future_only
    assert "G1: PASS (1 scenario)" in out and "G2: PASS (2 scenarios)" in out
    assert "G3: no scenarios" in out
    for mode in ("stock", "patched"):  # one line per mode as it starts and ends
        assert f"{mode} " in res.stderr and "started" in res.stderr
        assert any(line.startswith(f"[vllm-patch verify] {mode}") and "done in" in line
                   for line in res.stderr.splitlines())


@once_per_version
def test_verify_json_and_guarantee_filter(verify):
    res = verify("--json", "--guarantee", "G2")
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(res.stdout)
    assert data["exit_code"] == 0
    assert {r["name"] for r in data["scenarios"]} == {"fake_fixed_by_patch",
                                                     "fake_control"}
    assert list(data["guarantees"]) == ["G2"]
    assert data["guarantees"]["G2"]["verdict"] == "PASS"
    assert data["runs"]["stock"]["report"]["mode"] == "stock"
    assert data["runs"]["patched"]["report"]["mode"] == "patched"


@once_per_version
def test_verify_violated_when_patched_fails(verify):
    res = verify("-k", "fake_violated_patched", "-k", "fake_holds")
    assert res.returncode == 1, res.stdout + res.stderr[-3000:]
    assert "G3: FAIL" in res.stdout
    assert "patched: fake violation seen with patches on" in res.stdout
    assert "FAIL: violated when patched: fake_violated_patched" in res.stdout


@once_per_version
def test_verify_exception_is_a_violation(verify):
    res = verify("--json", "-k", "fake_raises", "-k", "fake_wrong_type")
    assert res.returncode == 1, res.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(res.stdout)["scenarios"]}
    assert rows["fake_raises"]["patched_violations"] == [
        "raised ValueError: fake scenario blew up"]
    assert rows["fake_wrong_type"]["patched"] is False


@once_per_version
def test_verify_child_crash(verify):
    res = verify("-k", "fake_kills_process")
    assert res.returncode == 3, res.stdout + res.stderr[-3000:]
    assert "run FAILED: exit status 7, no report" in res.stdout
    assert "G4: ERROR" in res.stdout


@once_per_version
def test_verify_child_timeout(verify):
    res = verify("-k", "fake_hangs", "--timeout", "25")
    assert res.returncode == 3, res.stdout + res.stderr[-3000:]
    assert "timed out after 25s" in res.stdout


@once_per_version
def test_verify_missing_scenario_module(capfd, monkeypatch):
    res = run_verify("--module", "no_such_scenarios_module", capfd=capfd,
                     monkeypatch=monkeypatch)
    assert res.returncode == 3, res.stdout + res.stderr[-3000:]
    assert "no_such_scenarios_module: ModuleNotFoundError" in res.stdout


@once_per_version
def test_verify_zero_scenarios_is_not_green(verify):
    res = verify("-k", "fake_future_only")  # exists, but not for this series
    assert res.returncode == 4, res.stdout + res.stderr[-3000:]
    assert "NO SCENARIOS RAN" in res.stdout
    assert verify("-k", "no_match_at_all", "--allow-empty").returncode == 0


# -- the runner in-process (no vLLM scenario needed) -----------------------------

def test_runner_loads_and_selects():
    sys.path.insert(0, str(FIXTURES))
    try:
        found, errors = conformance.load_scenarios(["fake_scenarios", "nope_mod"])
    finally:
        sys.path.remove(str(FIXTURES))
    assert [e["module"] for e in errors] == ["nope_mod"]
    names = [s.name for s in conformance.select(found, guarantees=["G2"])]
    assert names == ["fake_fixed_by_patch", "fake_control"]
    assert [s.name for s in conformance.select(found, names=["fake_raises"])] == [
        "fake_raises"]
    row = conformance.run_scenario(
        next(s for s in found if s.name == "fake_raises"), "0.32")
    assert row["holds"] is False and "Traceback" in row["traceback"]
    assert conformance.run_scenario(
        next(s for s in found if s.name == "fake_future_only"), "0.32"
    )["applicable"] is False


def test_scenario_guarantee_validated():
    with pytest.raises(ValueError, match="guarantee must be one of"):
        conformance.Scenario("x", "G7", "bad", lambda: [])


def test_shipped_scenario_modules_load():
    """SCENARIO_MODULES stays accurate: every listed module imports."""
    found, errors = conformance.load_scenarios()
    assert not errors, errors
    assert all(isinstance(s, conformance.Scenario) for s in found)
