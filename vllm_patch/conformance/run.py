"""Child entry point: run the conformance scenarios in this process.

    python -m vllm_patch.conformance --json [--guarantee G2] [--scenario NAME]
                                     [-k SUBSTRING] [--module MODULE]

Calls `vllm_patch.register()` first (so `VLLM_PATCH_DISABLE=1` gives stock
vLLM), runs each selected scenario that applies to the installed vLLM series,
and prints one report. With `--json` the report is the only thing on stdout:
everything else the process writes to fd 1 (vLLM's log handler, native
libraries) is sent to stderr.

Exit status: 0 every scenario run holds; 1 a scenario is violated or a
scenario module failed to load (the report is still printed); anything else
means the process crashed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

from vllm_patch import conformance


def _reserve_stdout() -> TextIO:
    """Keep the real stdout for the report; route fd 1 to stderr."""
    sys.stdout.flush()
    report_out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return report_out


def build_report(
    modules: list[str] | None,
    guarantees: list[str],
    names: list[str],
    keywords: list[str],
) -> dict[str, Any]:
    import vllm_patch
    from vllm_patch import envs, patching

    settings = envs.settings()
    vllm_patch.register()
    version = patching.vllm_version()
    series = patching.version_series(version)
    loaded, errors = conformance.load_scenarios(modules)
    chosen = conformance.select(loaded, guarantees, names, keywords)
    rows = []
    for scenario in chosen:
        print(f"[conformance] running {scenario.name}", file=sys.stderr, flush=True)
        rows.append(conformance.run_scenario(scenario, series))
    return {
        "vllm_patch": vllm_patch.__version__,
        "vllm": version,
        "series": series,
        "mode": "stock" if settings.disable else "patched",
        "modules": list(conformance.SCENARIO_MODULES if modules is None else modules),
        "errors": errors,
        "status": {row["guarantee"]: row["status"]
                   for row in patching.guarantee_table()},
        "scenarios": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_patch.conformance",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print a JSON report")
    parser.add_argument("--guarantee", action="append", default=[],
                        choices=conformance.GUARANTEE_IDS)
    parser.add_argument("--scenario", action="append", default=[], metavar="NAME",
                        help="exact scenario name (repeatable)")
    parser.add_argument("-k", dest="keyword", action="append", default=[],
                        metavar="SUBSTRING", help="scenario name contains (repeatable)")
    parser.add_argument("--module", action="append", default=None,
                        help="scenario module to load instead of the shipped ones "
                             "(repeatable; for testing scenario modules)")
    args = parser.parse_args(argv)

    out = _reserve_stdout() if args.json else sys.stdout
    report = build_report(args.module, args.guarantee, args.scenario, args.keyword)
    if args.json:
        json.dump(report, out, indent=1)
        out.write("\n")
        out.flush()
    else:
        print(f"vllm_patch {report['vllm_patch']} on vLLM {report['vllm']}, "
              f"{report['mode']}")
        for err in report["errors"]:
            print(f"ERROR    {err['module']}: {err['error']}")
        for row in report["scenarios"]:
            if not row["applicable"]:
                state = "n/a"
            else:
                state = "holds" if row["holds"] else "VIOLATED"
            first = row["violations"][0] if row["violations"] else ""
            print(f"{state:<8} {row['guarantee']} {row['name']}"
                  + (f": {first}" if first else ""))
    bad = report["errors"] or any(r["holds"] is False for r in report["scenarios"])
    return 1 if bad else 0
