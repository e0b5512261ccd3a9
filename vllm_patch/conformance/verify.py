"""`vllm-patch verify`: run the conformance scenarios stock and patched.

Each mode runs in its own child process (`python -m vllm_patch.conformance
--json`), stock with `VLLM_PATCH_DISABLE=1` and patched with
`VLLM_PATCH_DISABLE=0`, both at once (most of a child's time is importing
vLLM, which runs on one core), each bounded by `--timeout`.

Exit status:
  0  every selected scenario holds when patched
  1  a scenario is violated when patched
  3  a child process crashed, timed out, printed no report, or a scenario
     module failed to load
  4  no scenario ran (none shipped for this vLLM series, or the filters
     matched none); `--allow-empty` turns this into 0. A CI job must not go
     green on zero checks.
The first that applies in the order 3, 1, 4 wins.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm_patch import conformance

EXIT_OK, EXIT_VIOLATED, EXIT_CRASHED, EXIT_EMPTY = 0, 1, 3, 4
MODES = (("stock", "1"), ("patched", "0"))
DEFAULT_TIMEOUT = 1800.0


@dataclass
class ChildResult:
    mode: str
    seconds: float = 0.0
    returncode: int | None = None
    report: dict[str, Any] | None = None
    error: str = ""            # crash / timeout / no report
    stderr_tail: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "seconds": round(self.seconds, 1),
                "returncode": self.returncode, "error": self.error,
                "stderr_tail": self.stderr_tail, "report": self.report}


def _progress(msg: str) -> None:
    print(f"[vllm-patch verify] {msg}", file=sys.stderr, flush=True)


def child_command(args: Any) -> list[str]:
    cmd = [sys.executable, "-m", "vllm_patch.conformance", "--json"]
    for g in args.guarantee:
        cmd += ["--guarantee", g]
    for k in args.keyword:
        cmd += ["-k", k]
    for m in args.module or ():
        cmd += ["--module", m]
    return cmd


def run_child(mode: str, disable: str, cmd: list[str], timeout: float) -> ChildResult:
    result = ChildResult(mode)
    env = {**os.environ, "VLLM_PATCH_DISABLE": disable}
    _progress(f"{mode:<7} (VLLM_PATCH_DISABLE={disable}): started")
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            result.error = f"timed out after {timeout:g}s"
        result.seconds = time.monotonic() - start
        result.returncode = proc.returncode
        err.seek(0)
        result.stderr_tail = err.read().splitlines()[-30:]
    if not result.error:
        try:
            result.report = json.loads(out)
        except ValueError:
            result.error = f"exit status {proc.returncode}, no report on stdout"
        else:
            if proc.returncode not in (0, 1):
                result.error = f"exit status {proc.returncode} after its report"
    if not result.error and result.report and result.report["errors"]:
        result.error = "; ".join(f"{e['module']}: {e['error']}"
                                 for e in result.report["errors"])
    state = f"FAILED ({result.error})" if result.error else "done"
    _progress(f"{mode:<7}: {state} in {result.seconds:.1f}s")
    return result


def _scenario_rows(results: dict[str, ChildResult]) -> list[dict[str, Any]]:
    """Merge both modes' reports: one row per scenario, in run order."""
    rows: dict[str, dict[str, Any]] = {}
    for mode, res in results.items():
        for sc in (res.report or {}).get("scenarios", []):
            row = rows.setdefault(sc["name"], {
                "name": sc["name"], "guarantee": sc["guarantee"],
                "description": sc["description"], "stock_fails": sc["stock_fails"],
                "applicable": sc["applicable"], "stock": None, "patched": None,
                "stock_violations": [], "patched_violations": [], "notes": [],
            })
            row[mode] = sc["holds"]
            row[f"{mode}_violations"] = sc["violations"]
    for row in rows.values():
        if not row["applicable"]:
            row["notes"].append("not applicable to this vLLM series")
        elif row["stock"] is True and row["stock_fails"]:
            row["notes"].append("stock already holds here (upstream fix?)")
        elif row["stock"] is False and not row["stock_fails"]:
            row["notes"].append("control violated on stock")
    return list(rows.values())


def _guarantee_summary(rows: list[dict[str, Any]], patched: ChildResult,
                       selected: list[str]) -> dict[str, dict[str, Any]]:
    summary = {}
    for gid in selected:
        mine = [r for r in rows if r["guarantee"] == gid and r["applicable"]]
        violated = [r["name"] for r in mine if r["patched"] is False]
        if patched.error and patched.report is None:
            verdict = "ERROR"
        elif not mine:
            verdict = "no scenarios"
        elif violated:
            verdict = "FAIL"
        elif all(r["patched"] is True for r in mine):
            verdict = "PASS"
        else:
            verdict = "ERROR"
        status = ((patched.report or {}).get("status") or {}).get(gid, "")
        summary[gid] = {"verdict": verdict, "scenarios": len(mine),
                        "violated": violated, "patched_status": status}
    return summary


def _cell(holds: bool | None) -> str:
    return {True: "holds", False: "violated", None: "-"}[holds]


def _first_violation(row: dict[str, Any]) -> str:
    if row["patched_violations"]:
        return "patched: " + row["patched_violations"][0]
    if row["stock_violations"]:
        return "stock: " + row["stock_violations"][0]
    return ""


def _print_text(results: dict[str, ChildResult], rows: list[dict[str, Any]],
                summary: dict[str, dict[str, Any]], verdict: str) -> None:
    report = next((r.report for r in results.values() if r.report), None)
    if report:
        print(f"vllm_patch {report['vllm_patch']} verify on vLLM {report['vllm']}")
    width = max([len(r["name"]) for r in rows] + [8])
    print(f"{'scenario':<{width}}  guar  {'stock':<8}  {'patched':<8}  first violation")
    for row in rows:
        if not row["applicable"]:
            print(f"{row['name']:<{width}}  {row['guarantee']:<4}  "
                  f"{'n/a':<8}  {'n/a':<8}  (not applicable to this vLLM series)")
            continue
        text = _first_violation(row)
        if len(text) > 120:
            text = text[:117] + "..."
        print(f"{row['name']:<{width}}  {row['guarantee']:<4}  "
              f"{_cell(row['stock']):<8}  {_cell(row['patched']):<8}  {text}")
        for note in row["notes"]:
            print(f"{'':<{width}}  note: {note}")
    for mode, res in results.items():
        if res.error:
            print(f"\n{mode} run FAILED: {res.error}")
            for line in res.stderr_tail[-15:]:
                print(f"    {line}")
    print("\nsummary:")
    for gid, s in summary.items():
        extra = f" ({s['scenarios']} scenario{'s' if s['scenarios'] != 1 else ''}"
        extra += f", {len(s['violated'])} violated when patched)" if s["violated"] else ")"
        if s["verdict"] in ("no scenarios", "ERROR"):
            extra = ""
        status = f"  [status: {s['patched_status']}]" if s["patched_status"] else ""
        print(f"  {gid}: {s['verdict']}{extra}{status}")
    print(verdict)


def verify(args: Any) -> int:
    cmd = child_command(args)
    with ThreadPoolExecutor(len(MODES)) as pool:
        futures = {mode: pool.submit(run_child, mode, disable, cmd, args.timeout)
                   for mode, disable in MODES}
        results = {mode: f.result() for mode, f in futures.items()}
    rows = _scenario_rows(results)
    selected = list(args.guarantee) or list(conformance.GUARANTEE_IDS)
    summary = _guarantee_summary(rows, results["patched"], selected)
    ran = [r for r in rows if r["applicable"]]
    crashed = [m for m, r in results.items() if r.error]
    violated = [r["name"] for r in ran if r["patched"] is False]
    if crashed:
        code = EXIT_CRASHED
        verdict = f"ERROR: the {' and '.join(crashed)} run failed (see above)"
    elif violated:
        code = EXIT_VIOLATED
        verdict = f"FAIL: violated when patched: {', '.join(violated)}"
    elif not ran:
        code = EXIT_OK if args.allow_empty else EXIT_EMPTY
        verdict = ("NO SCENARIOS RAN: nothing was checked on this vLLM"
                   + (" (--allow-empty)" if args.allow_empty
                      else "; exit 4 (use --allow-empty to accept)"))
    else:
        code = EXIT_OK
        verdict = f"PASS: {len(ran)} scenario(s) hold when patched"
    if args.json:
        json.dump({"exit_code": code, "verdict": verdict, "guarantees": summary,
                   "scenarios": rows,
                   "runs": {m: r.to_json() for m, r in results.items()}},
                  sys.stdout, indent=2)
        print()
    else:
        _print_text(results, rows, summary, verdict)
    return code
